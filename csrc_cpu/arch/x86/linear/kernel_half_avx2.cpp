// AVX2 build of the f16 / bf16 weight layouts' kernel (half.h), shared by
// every x86 build past scalar. A k-chunk of 8 weights is widened once
// (vcvtph2ps for float16, a zero-extend and a 16-bit shift for bfloat16:
// both exact) and serves every x row of a register tile; lane l of an
// accumulator holds the definition's chain k % 8 == l, so a row's bits never
// depend on the rows or weight rows beside it. Tiles: 1 x row by 8 weight
// rows (decode: eight independent chains hide the fma latency), 4 by 3
// (prompt rows: 12 accumulators, one weight vector live, x read by the fmas
// from L1; one conversion per 4 fmas, against 3 by 4's per 3, was 1.2x at
// 128 rows on Zen 3), then 3 by 4 or 2 by 6 for the last rows, x row
// groups outer and the chunk's weight rows inner, so a group's
// x stays in L1 while the chunk's weight (24 rows) comes from L2. No
// software prefetch: the decode tile's eight sequential row streams ran
// faster on the hardware prefetcher alone (Zen 3, 512 or 256 bytes ahead
// were slower).
#include <immintrin.h>

#include <cstring>

#include "arch/target.h"
#include "linear/half.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")

namespace paged::cpu::linear::isa_avx2 {
namespace {

// Eight weights k .. k+7 of a row as float32 (exact).
template <bool kBf16>
inline __m256 widen(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if constexpr (kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// hsum8 (quant_linear.h) of lanes in their natural positions:
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float hsum8_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4, l1+l5, l2+l6, l3+l7
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                          // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Outputs (r0 .. r0+R-1) x (n0 .. n0+C-1) over the whole K.
template <bool kBf16, int R, int C>
void tile(const HalfArgs& h, int64_t r0, int64_t n0) {
  const int64_t K = h.K, body = K & ~int64_t(7);
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* w = h.w + n0 * K;
  const float* x = h.x + r0 * K;
  // a weight row's whole 64-byte line (32 values, four chunks in chain
  // order) before the next row's: 1.2-1.7x the bandwidth of one chunk per
  // row per step at decode (Zen 3, eight rows 4 KB apart), same sums
  const int64_t lines = K & ~int64_t(31);
  int64_t k = 0;
  for (; k < lines; k += 32)
    for (int j = 0; j < C; ++j)
      for (int u = 0; u < 32; u += 8) {
        const __m256 wv = widen<kBf16>(w + j * K + k + u);
        for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + k + u), acc[i][j]);
      }
  for (; k < body; k += 8) {
    for (int j = 0; j < C; ++j) {
      const __m256 wv = widen<kBf16>(w + j * K + k);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * K + k), acc[i][j]);
    }
  }
  if (body < K) {  // the tail, zero-padded in both operands (half.h: adds nothing)
    alignas(32) uint16_t wt[8];
    alignas(32) float xt[8];
    for (int j = 0; j < C; ++j) {
      std::memset(wt, 0, sizeof wt);
      std::memcpy(wt, w + j * K + body, size_t(K - body) * sizeof(uint16_t));
      const __m256 wv = widen<kBf16>(wt);
      for (int i = 0; i < R; ++i) {
        std::memset(xt, 0, sizeof xt);
        std::memcpy(xt, x + i * K + body, size_t(K - body) * sizeof(float));
        acc[i][j] = _mm256_fmadd_ps(wv, _mm256_load_ps(xt), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) h.out[(r0 + i) * h.N + n0 + j] = hsum8_lanes(acc[i][j]);
}

// Weight rows [n, n1) for x rows r0 .. r0+R-1: tiles of C, then narrower ones for the rest.
template <bool kBf16, int R, int C>
void columns(const HalfArgs& h, int64_t r0, int64_t n, int64_t n1) {
  for (; n + C <= n1; n += C) tile<kBf16, R, C>(h, r0, n);
  if constexpr (C > 1) columns<kBf16, R, C - 1>(h, r0, n, n1);
}

template <bool kBf16>
void rows(const HalfArgs& h, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; r + 4 <= h.M; r += 4) columns<kBf16, 4, 3>(h, r, n0, n1);
  if (h.M - r == 3) columns<kBf16, 3, 4>(h, r, n0, n1);
  if (h.M - r == 2) columns<kBf16, 2, 6>(h, r, n0, n1);
  if (h.M - r == 1) columns<kBf16, 1, 8>(h, r, n0, n1);
}

}  // namespace

void half_rows(const HalfArgs& h, int64_t n0, int64_t n1) {
  if (h.bf16) rows<true>(h, n0, n1);
  else rows<false>(h, n0, n1);
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
