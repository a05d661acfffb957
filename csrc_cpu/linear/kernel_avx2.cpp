// AVX2 + FMA build of the quantized linear, as register tiles of outputs
// (activation rows x weight rows) that all keep the per-output order of
// quant_linear.h:
//  - few rows (M <= kDirectMaxRows): each block is widened from its packed
//    bytes in registers and used for every row of x; several weight rows per
//    pass give independent accumulator chains and share the x loads.
//  - many rows: a panel of weight rows is widened to fp32 codes into the
//    thread's scratch once, then every tile of x rows sweeps it, so each x
//    vector loaded serves kPanelCols weight rows and each code vector
//    kPanelRows x rows, all from L1.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

#include "linear/quant_linear.h"

#define PAGED_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace paged::cpu::linear::isa_avx2 {
namespace {

// Tile shapes. Outputs per tile: one partial t and one accumulator each, so the
// panel tile holds 2 * 2 * 3 = 12 ymm, plus 2 x vectors, 1 code and 1 scale.
constexpr int kPanelRows = 2;   // x rows per panel tile
constexpr int kPanelCols = 3;   // weight rows per panel tile
constexpr int64_t kPanel = 12;  // weight rows widened per panel (multiple of kPanelCols)
constexpr int kDirectCols = 2;  // weight rows per direct pass (x rows: all M <= kDirectMaxRows)

constexpr int64_t kAlignFloats = 16;  // 64 bytes, one cache line
float* aligned(float* p) {
  const auto misalign = reinterpret_cast<uintptr_t>(p) % (kAlignFloats * sizeof(float));
  return misalign ? p + (kAlignFloats * sizeof(float) - misalign) / sizeof(float) : p;
}

// Sources of a block's codes: 4 vectors holding elements 0-7, 8-15, 16-23, 24-31.
template <bool kMinus8>
struct Nibbles {  // Q4_0 (codes q - 8) / Q4_1 (codes q)
  const uint8_t* row;
  // Bytes 0-7 / 8-15 zero-extended to 32-bit lanes: their low nibbles are
  // elements 0-7 / 8-15, their high nibbles (a plain shift) 16-23 / 24-31.
  PAGED_AVX2 void load(int64_t b, __m256 q[4]) const {
    const uint8_t* p = row + b * (kBlock / 2);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i codes[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask), _mm256_srli_epi32(first, 4),
                        _mm256_srli_epi32(second, 4)};
    for (int i = 0; i < 4; ++i) {
      if constexpr (kMinus8) codes[i] = _mm256_sub_epi32(codes[i], _mm256_set1_epi32(8));
      q[i] = _mm256_cvtepi32_ps(codes[i]);
    }
  }
};

struct Bytes {  // Q8_0
  const uint8_t* row;
  PAGED_AVX2 void load(int64_t b, __m256 q[4]) const {
    const uint8_t* p = row + b * kBlock;
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};

PAGED_AVX2 inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// Q4_1's offset sums sm[r, n] = sum_b m[n, b] * xs[b, r] (block order) of
// weight rows n0 .. n1 for every x row, 8 x rows per vector, parked in out
// until the tiles add their hsum.
PAGED_AVX2 void offsets_into_out(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.blocks(), M = a.M;
  for (int64_t n = n0; n < n1; ++n) {
    const float* m = a.m + n * nb;
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) {
      __m256 sm = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b)
        sm = _mm256_fmadd_ps(_mm256_broadcast_ss(m + b), _mm256_loadu_ps(a.xs + b * M + r), sm);
      float lanes[8];
      _mm256_storeu_ps(lanes, sm);
      for (int l = 0; l < 8; ++l) a.out[(r + l) * a.N + n] = lanes[l];
    }
    for (; r < M; ++r) {
      float sm = 0.f;
      for (int64_t b = 0; b < nb; ++b) sm = __builtin_fmaf(m[b], a.xs[b * M + r], sm);
      a.out[r * a.N + n] = sm;
    }
  }
}

// out[r0 .. r0+R, n0 .. n0+C] with every block widened in registers from the
// packed rows; the x loads of a block are shared by the C weight rows.
template <class Src, int R, int C>
PAGED_AVX2 void direct_tile(const LinearArgs& a, int64_t n0, int64_t r0) {
  const int64_t nb = a.blocks();
  Src src[C];
  const float* d[C];
  for (int c = 0; c < C; ++c) {
    src[c] = Src{a.qs + (n0 + c) * a.row_bytes()};
    d[c] = a.d + (n0 + c) * nb;
  }
  const float* x[R];
  __m256 acc[R][C];
  float sm[R][C];  // Q4_1's offset sums, off the vector units' critical path
  for (int r = 0; r < R; ++r) {
    x[r] = a.x + (r0 + r) * a.K;
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      sm[r][c] = 0.f;
    }
  }
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < C; ++c) {
      if (a.m)
        for (int r = 0; r < R; ++r) sm[r][c] = __builtin_fmaf(a.m[(n0 + c) * nb + b], a.xs[b * a.M + r0 + r], sm[r][c]);
      __m256 q[4];
      src[c].load(b, q);
      const __m256 db = _mm256_broadcast_ss(d[c] + b);
      for (int r = 0; r < R; ++r) {
        const float* xb = x[r] + b * kBlock;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
        acc[r][c] = _mm256_fmadd_ps(db, t, acc[r][c]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a.out[(r0 + r) * a.N + n0 + c] = hsum(acc[r][c]) + sm[r][c];
}

// out[r0 .. r0+R, n0 .. n0+C] from fp32 codes already widened into `codes`
// (row n0 + c at codes + c * K). Vector i of a block is loaded once per x row
// and once per weight row, then feeds R * C independent partials.
template <int R, int C>
PAGED_AVX2 void panel_tile(const LinearArgs& a, const float* codes, int64_t n0, int64_t r0) {
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
        const __m256 qv = _mm256_loadu_ps(codes + c * K + k0 + 8 * i);
        for (int r = 0; r < R; ++r)
          t[r][c] = i == 0 ? _mm256_mul_ps(qv, xv[r]) : _mm256_fmadd_ps(qv, xv[r], t[r][c]);
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
      out = hsum(acc[r][c]) + (a.m ? out : 0.f);  // out holds Q4_1's offset sum
    }
}

// Tile instantiations indexed [rows - 1][cols - 1], so edges use exact shapes.
using DirectFn = void (*)(const LinearArgs&, int64_t n0, int64_t r0);
using PanelFn = void (*)(const LinearArgs&, const float* codes, int64_t n0, int64_t r0);

template <class Src, int R, int... C>
constexpr std::array<DirectFn, sizeof...(C)> direct_row(std::integer_sequence<int, C...>) {
  return {&direct_tile<Src, R, C + 1>...};
}
template <class Src, int... R>
constexpr auto direct_table(std::integer_sequence<int, R...>) {
  return std::array{direct_row<Src, R + 1>(std::make_integer_sequence<int, kDirectCols>())...};
}
template <int R, int... C>
constexpr std::array<PanelFn, sizeof...(C)> panel_row(std::integer_sequence<int, C...>) {
  return {&panel_tile<R, C + 1>...};
}
template <int... R>
constexpr auto panel_table(std::integer_sequence<int, R...>) {
  return std::array{panel_row<R + 1>(std::make_integer_sequence<int, kPanelCols>())...};
}

// Few rows of x: all of them in one tile, kDirectCols weight rows per pass.
template <class Src>
PAGED_AVX2 void direct_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  static constexpr auto tiles = direct_table<Src>(std::make_integer_sequence<int, int(kDirectMaxRows)>());
  const auto& by_cols = tiles[size_t(a.M - 1)];
  for (int64_t n = n0; n < n1; n += kDirectCols)
    by_cols[size_t(std::min<int64_t>(kDirectCols, n1 - n) - 1)](a, n, 0);
}

// Many rows: per panel of weight rows, widen the codes once, then sweep all
// tiles of x over it.
template <class Src>
PAGED_AVX2 void panel_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  static constexpr auto tiles = panel_table(std::make_integer_sequence<int, kPanelRows>());
  const int64_t nb = a.blocks(), K = a.K;
  scratch.resize(size_t(kPanel * K + kAlignFloats));
  float* codes = aligned(scratch.data());  // no loads split across cache lines
  for (int64_t p0 = n0; p0 < n1; p0 += kPanel) {
    const int64_t p1 = std::min(n1, p0 + kPanel);
    for (int64_t n = p0; n < p1; ++n) {
      const Src src{a.qs + n * a.row_bytes()};
      float* row = codes + (n - p0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        __m256 q[4];
        src.load(b, q);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(row + b * kBlock + 8 * i, q[i]);
      }
    }
    if (a.m) offsets_into_out(a, p0, p1);
    for (int64_t r = 0; r < a.M; r += kPanelRows) {
      const auto& by_cols = tiles[size_t(std::min<int64_t>(kPanelRows, a.M - r) - 1)];
      for (int64_t n = p0; n < p1; n += kPanelCols)
        by_cols[size_t(std::min<int64_t>(kPanelCols, p1 - n) - 1)](a, codes + (n - p0) * K, n, r);
    }
  }
}

template <class Src>
PAGED_AVX2 void rows_of(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  if (a.M <= kDirectMaxRows)
    direct_rows<Src>(a, n0, n1);
  else
    panel_rows<Src>(a, n0, n1, scratch);
}

}  // namespace

PAGED_AVX2 void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  switch (a.qtype) {
    case QType::Q4_0: rows_of<Nibbles<true>>(a, n0, n1, scratch); break;
    case QType::Q4_1: rows_of<Nibbles<false>>(a, n0, n1, scratch); break;
    case QType::Q8_0: rows_of<Bytes>(a, n0, n1, scratch); break;
  }
}

}  // namespace paged::cpu::linear::isa_avx2
