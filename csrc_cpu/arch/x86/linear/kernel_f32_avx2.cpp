// AVX2 + FMA build of the fp32 path (quant_linear.h): a block's 32 codes
// become four fp32 vectors, t = 1 multiply + 3 fmas with the fp32 x, then one
// fma with the weight's scale d.
//  - few rows (M <= kDirectMaxRows): the shared direct tiles, every block
//    widened in registers from its packed bytes.
//  - many rows: a panel of weight rows is widened to fp32 codes into the
//    thread's scratch once, then every tile of x rows sweeps it, so each x
//    vector loaded serves kPanelCols weight rows and each code vector
//    kPanelRows x rows, all from L1.
#include "arch/x86/linear/avx2_tiles.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")
namespace paged::cpu::linear::isa_avx2 {
namespace {

// Panel tile: one partial t and one accumulator per output, so 2 x 3 holds
// 12 ymm plus 2 x vectors, 1 code and 1 scale.
constexpr int kPanelRows = 2;   // x rows per panel tile
constexpr int kPanelCols = 3;   // weight rows per panel tile
constexpr int64_t kPanel = 12;  // weight rows widened per panel (multiple of kPanelCols)

constexpr int64_t kAlignFloats = 16;  // 64 bytes, one cache line
float* aligned(float* p) {
  const auto misalign = reinterpret_cast<uintptr_t>(p) % (kAlignFloats * sizeof(float));
  return misalign ? p + (kAlignFloats * sizeof(float) - misalign) / sizeof(float) : p;
}

// t = Q[0:8]*x[0:8], then fma with elements 8-15, 16-23, 24-31.
inline __m256 block_dot(const __m256 q[4], const float* xb) {
  __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
  t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
  t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
  return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
}

struct Fp32Path {
  struct Codes {
    __m256 v[4];
  };
  struct Row {
    const float* x = nullptr;
    Row() = default;
    Row(const LinearArgs& a, int64_t r) : x(a.x + r * a.K) {}
    void begin_block(int64_t) {}
    __m256 dot(const Codes& q, int64_t b) const { return block_dot(q.v, x + b * kBlock); }
  };
};

// out[r0 .. r0+R, n0 .. n0+C] from fp32 codes already widened into `codes`
// (row n0 + c at codes + c * K), the same per-output arithmetic as block_dot
// but interleaved over the tile: vector i of a block is loaded once per x row
// and once per weight row, then feeds R * C independent partials.
template <int R, int C>
void panel_tile(const LinearArgs& a, const float* codes, int64_t n0, int64_t r0) {
  const int64_t nb = a.blocks(), K = a.K;
  const float* d[C];
  for (int c = 0; c < C; ++c) d[c] = a.d + (n0 + c) * nb;
  const float* x[R];
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    x[r] = a.x + (r0 + r) * K;
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k0 = b * kBlock;
    __m256 t[R][C];
    for (int i = 0; i < 4; ++i) {
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + k0 + 8 * i);
      for (int c = 0; c < C; ++c) {
        const __m256 qv = _mm256_load_ps(codes + c * K + k0 + 8 * i);
        for (int r = 0; r < R; ++r) t[r][c] = i == 0 ? _mm256_mul_ps(qv, xv[r]) : _mm256_fmadd_ps(qv, xv[r], t[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m256 db = _mm256_broadcast_ss(d[c] + b);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(db, t[r][c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.out[(r0 + r) * a.N + n0 + c];
      out = tiles::hsum(acc[r][c]) + (a.m ? out : 0.f);  // out holds Q4_1's offset sum
    }
}

using PanelFn = void (*)(const LinearArgs&, const float* codes, int64_t n0, int64_t r0);
template <int R, int... C>
constexpr std::array<PanelFn, sizeof...(C)> panel_row(std::integer_sequence<int, C...>) {
  return {&panel_tile<R, C + 1>...};
}
template <int... R>
constexpr auto panel_table(std::integer_sequence<int, R...>) {
  return std::array{panel_row<R + 1>(std::make_integer_sequence<int, kPanelCols>())...};
}

// Many rows: per panel of weight rows, widen the codes once, then sweep all
// tiles of x over it.
template <class Src>
void panel_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  static constexpr auto panel_tiles = panel_table(std::make_integer_sequence<int, kPanelRows>());
  const int64_t nb = a.blocks(), K = a.K;
  scratch.resize(size_t(kPanel * K + kAlignFloats));
  float* codes = aligned(scratch.data());  // K is a multiple of 32: every block vector is aligned
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t p1 = std::min(n1, p0 + kPanel);
    for (int64_t n = p0; n < p1; ++n) {
      const Src src{a.qs + n * a.row_bytes()};
      float* row = codes + (n - p0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        __m256 q[4];
        src.load(b, q);
        for (int i = 0; i < 4; ++i) _mm256_store_ps(row + b * kBlock + 8 * i, q[i]);
      }
    }
    if (a.m) tiles::offset_sums_into_out(a, p0, p1);
    for (int64_t r = 0; r < a.M; r += kPanelRows) {
      const auto& by_cols = panel_tiles[size_t(std::min<int64_t>(kPanelRows, a.M - r) - 1)];
      for (int64_t n = p0; n < p1; n += kPanelCols)
        by_cols[size_t(std::min<int64_t>(kPanelCols, p1 - n) - 1)](a, codes + (n - p0) * K, n, r);
    }
  }
}

template <class Src>
struct Fp32Rows {
  static void run(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
    if (a.M <= kDirectMaxRows)
      tiles::direct_rows<Fp32Path, Src>(a, n0, n1);
    else
      panel_rows<Src>(a, n0, n1, scratch);
  }
};

}  // namespace

void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  tiles::by_qtype<Fp32Rows>(a, n0, n1, scratch);
}

}  // namespace paged::cpu::linear::isa_avx2
PAGED_TARGET_END()
