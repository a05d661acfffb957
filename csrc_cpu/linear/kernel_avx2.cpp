// AVX2 + FMA build of the quantized linear with two-term int16 activations, as
// register tiles of outputs (activation rows x weight rows) that all keep the
// per-output order of quant_linear.h. A block's 32 codes become two int16
// vectors (elements 0-15, 16-31), shared by both activation terms; per term
// two vpmaddwd and one add give the 8 exact int32 lane sums, then per block
// two converts, a multiply by s, an fma with s_lo and an fma with the
// weight's scale d.
//  - few rows (M <= kDirectMaxRows): each block is widened from its packed
//    bytes in registers and used for every row of x; several weight rows per
//    pass give independent accumulator chains and share the x loads.
//  - many rows: a panel of weight rows is widened to int16 codes into the
//    thread's scratch once, then every tile of x rows sweeps it from L1.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

#include "linear/quant_linear.h"

#define PAGED_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace paged::cpu::linear::isa_avx2 {
namespace {

// Tile shapes, measured on one Zen core: direct 8 or 12 outputs and panel
// 2 x 4 or 3 x 4 tie; 4 x 4 direct / 4 x 2 panel are 1.1-1.8x slower.
constexpr int kPanelRows = 3;   // x rows per panel tile
constexpr int kPanelCols = 4;   // weight rows per panel tile
constexpr int64_t kPanel = 24;  // weight rows widened per panel (multiple of kPanelCols)
// Direct passes: all M <= kDirectMaxRows x rows by kDirectOutputs / M weight
// rows, so the accumulators stay within the 16 ymm (4 x 4 spilled: ~1.8x slower).
constexpr int kDirectOutputs = 8;

constexpr uintptr_t kAlignBytes = 64;  // one cache line
int16_t* aligned(int16_t* p) {
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(p) % kAlignBytes;
  return misalign ? p + (kAlignBytes - misalign) / sizeof(int16_t) : p;
}

// Packed rows stream from DRAM at M = 1 (the model's weights do not fit in
// L3); asking for the bytes this far ahead keeps more misses in flight (1 thread,
// whole model at M = 1: ~15 ms without, 10-14 ms with 1.5-6 KB; noisy host).
constexpr int64_t kPrefetchBytes = 3072;
inline void prefetch_ahead(const uint8_t* p) {
  // As an integer: the address may lie past the weight (a prefetch never faults).
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes), _MM_HINT_T0);
}

// Sources of a block's codes as two int16 vectors: elements 0-15 and 16-31.
template <bool kMinus8>
struct Nibbles {  // Q4_0 (codes q - 8) / Q4_1 (codes q)
  const uint8_t* row;
  PAGED_AVX2 void prefetch(int64_t b) const { prefetch_ahead(row + b * (kBlock / 2)); }
  // Byte j's low nibble is element j, its high nibble element 16 + j.
  PAGED_AVX2 void load(int64_t b, __m256i q[2]) const {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2))));
    q[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(bytes, 4);
    if constexpr (kMinus8) {
      q[0] = _mm256_sub_epi16(q[0], _mm256_set1_epi16(8));
      q[1] = _mm256_sub_epi16(q[1], _mm256_set1_epi16(8));
    }
  }
};

struct Bytes {  // Q8_0
  const uint8_t* row;
  PAGED_AVX2 void prefetch(int64_t b) const { prefetch_ahead(row + b * kBlock); }
  PAGED_AVX2 void load(int64_t b, __m256i q[2]) const {
    const uint8_t* p = row + b * kBlock;
    q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
};

struct Widened {  // int16 codes already in the panel scratch (in L1: no prefetch)
  const int16_t* row;
  void prefetch(int64_t) const {}
  PAGED_AVX2 void load(int64_t b, __m256i q[2]) const {
    q[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
    q[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + b * kBlock + 16));
  }
};

// Exact int32 lane sums of a block's codes times 16 + 16 int16 activations.
PAGED_AVX2 inline __m256i lane_dots(const __m256i q[2], const int16_t* x) {
  const __m256i lo = _mm256_madd_epi16(q[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  const __m256i hi = _mm256_madd_epi16(q[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  return _mm256_add_epi32(lo, hi);
}

// t = fma(float(L), s_lo, s * float(I)) over one block: I from the hi codes, L
// from the lo codes (x points at the block's hi codes, its lo codes follow).
PAGED_AVX2 inline __m256 scaled_dot(const __m256i q[2], const int16_t* x, __m256 s, __m256 s_lo) {
  const __m256 hi = _mm256_mul_ps(s, _mm256_cvtepi32_ps(lane_dots(q, x)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_dots(q, x + kBlock)), s_lo, hi);
}

PAGED_AVX2 inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// Q4_1's offset sums sm[r, n] = sum_b m[n, b] * xs[b, r] (one fma chain per
// output, in block order) of weight rows n0 .. n1 for every x row, written
// into out: 8 x rows per vector, then the rest with the chains of all weight
// rows interleaved, so no loop waits on one fma's latency.
PAGED_AVX2 void offset_sums_into_out(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.blocks(), M = a.M, N = a.N;
  int64_t r = 0;
  for (; r + 8 <= M; r += 8)
    for (int64_t n = n0; n < n1; ++n) {
      const float* m = a.m + n * nb;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b)
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(m + b), _mm256_loadu_ps(a.xs + b * M + r), acc);
      float lanes[kLanes];
      _mm256_storeu_ps(lanes, acc);
      for (int l = 0; l < kLanes; ++l) a.out[(r + l) * N + n] = lanes[l];
    }
  for (; r < M; ++r) {
    float* sm = a.out + r * N;
    std::fill(sm + n0, sm + n1, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const float xs = a.xs[b * M + r];
      for (int64_t n = n0; n < n1; ++n) sm[n] = __builtin_fmaf(a.m[n * nb + b], xs, sm[n]);
    }
  }
}

// out[r0 .. r0+R, n0 .. n0+C] = the per-output sums of quant_linear.h with the
// codes of weight row n0 + c from src[c]; a block's activations and scales are
// shared by the C weight rows, its codes by the R x rows. With `add_out`, out
// already holds Q4_1's offset sums.
template <class Src, int R, int C>
PAGED_AVX2 void tile(const LinearArgs& a, const Src* src, int64_t n0, int64_t r0, bool add_out) {
  const int64_t nb = a.blocks();
  const float* d[C];
  for (int c = 0; c < C; ++c) d[c] = a.d + (n0 + c) * nb;
  const int16_t* x[R];
  const float* s[R];
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    x[r] = a.xq + (r0 + r) * nb * kXBlock;
    s[r] = a.xscale + (r0 + r) * nb * 2;
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256 sb[R], sb_lo[R];
    for (int r = 0; r < R; ++r) {
      sb[r] = _mm256_broadcast_ss(s[r] + 2 * b);
      sb_lo[r] = _mm256_broadcast_ss(s[r] + 2 * b + 1);
    }
    for (int c = 0; c < C; ++c) {
      __m256i q[2];
      src[c].load(b, q);
      src[c].prefetch(b);
      const __m256 db = _mm256_broadcast_ss(d[c] + b);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(db, scaled_dot(q, x[r] + b * kXBlock, sb[r], sb_lo[r]), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.out[(r0 + r) * a.N + n0 + c];
      out = hsum(acc[r][c]) + (add_out ? out : 0.f);
    }
}

// Tile instantiations indexed [rows - 1][cols - 1], so edges use exact shapes.
template <class Src>
using TileFn = void (*)(const LinearArgs&, const Src*, int64_t n0, int64_t r0, bool add_out);

template <class Src, int R, int... C>
constexpr std::array<TileFn<Src>, sizeof...(C)> tile_row(std::integer_sequence<int, C...>) {
  return {&tile<Src, R, C + 1>...};
}
template <class Src, int Cols, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array{tile_row<Src, R + 1>(std::make_integer_sequence<int, Cols>())...};
}

// Few rows of x: all of them in one tile, kDirectOutputs / M weight rows per pass.
template <class Src>
PAGED_AVX2 void direct_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  static constexpr auto tiles =
      tile_table<Src, kDirectOutputs>(std::make_integer_sequence<int, int(kDirectMaxRows)>());
  const auto& by_cols = tiles[size_t(a.M - 1)];
  const int64_t per_pass = std::max<int64_t>(1, kDirectOutputs / a.M);
  if (a.m) offset_sums_into_out(a, n0, n1);
  for (int64_t n = n0; n < n1; n += per_pass) {
    const int cols = int(std::min<int64_t>(per_pass, n1 - n));
    Src src[kDirectOutputs];
    for (int c = 0; c < cols; ++c) src[c] = Src{a.qs + (n + c) * a.row_bytes()};
    by_cols[size_t(cols - 1)](a, src, n, 0, a.m != nullptr);
  }
}

// Many rows: per panel of weight rows, widen the codes once, then sweep all
// tiles of x over it.
template <class Src>
PAGED_AVX2 void panel_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch) {
  static constexpr auto tiles = tile_table<Widened, kPanelCols>(std::make_integer_sequence<int, kPanelRows>());
  const int64_t nb = a.blocks(), K = a.K;
  scratch.resize(size_t(kPanel * K) + kAlignBytes / sizeof(int16_t));
  int16_t* codes = aligned(scratch.data());  // whole-line vector loads
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t p1 = std::min(n1, p0 + kPanel);
    for (int64_t n = p0; n < p1; ++n) {
      const Src src{a.qs + n * a.row_bytes()};
      int16_t* row = codes + (n - p0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        __m256i q[2];
        src.load(b, q);
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + b * kBlock), q[0]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(row + b * kBlock + 16), q[1]);
      }
    }
    if (a.m) offset_sums_into_out(a, p0, p1);
    for (int64_t r = 0; r < a.M; r += kPanelRows) {
      const auto& by_cols = tiles[size_t(std::min<int64_t>(kPanelRows, a.M - r) - 1)];
      for (int64_t n = p0; n < p1; n += kPanelCols) {
        const int cols = int(std::min<int64_t>(kPanelCols, p1 - n));
        Widened src[kPanelCols];
        for (int c = 0; c < cols; ++c) src[c] = Widened{codes + (n + c - p0) * K};
        by_cols[size_t(cols - 1)](a, src, n, r, a.m != nullptr);
      }
    }
  }
}

template <class Src>
PAGED_AVX2 void rows_of(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch) {
  if (a.M <= kDirectMaxRows)
    direct_rows<Src>(a, n0, n1);
  else
    panel_rows<Src>(a, n0, n1, scratch);
}

}  // namespace

PAGED_AVX2 void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch) {
  switch (a.qtype) {
    case QType::Q4_0: rows_of<Nibbles<true>>(a, n0, n1, scratch); break;
    case QType::Q4_1: rows_of<Nibbles<false>>(a, n0, n1, scratch); break;
    case QType::Q8_0: rows_of<Bytes>(a, n0, n1, scratch); break;
  }
}

}  // namespace paged::cpu::linear::isa_avx2
