// AVX2 build of the s16 layout's kernel (s16.h), shared by every x86 build
// past scalar: a block's eight int32 lane sums of one weight row with up to
// four x rows from vpmaddubsw on |w| and x * sign(w) (vpabsb, vpsignb: pairs
// <= 2 * 128 * 127 < 2^15) and vpmaddwd by ones, the lanes scaled per half
// and accumulated with one fma each, as the scalar definition does.
#include <immintrin.h>

#include <algorithm>

#include "arch/target.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma")

namespace paged::cpu::linear::isa_avx2 {
namespace {

constexpr int kRowsPerTile = 4;

// The eight lane sums of 32 weight codes with 32 x codes.
inline __m256i lane_sums(__m256i wabs, __m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

template <int R>
void tile(const S16Args& s, int64_t r0, int64_t n) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  const auto* w = reinterpret_cast<const int8_t*>(a.qs) + n * K;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i wabs = _mm256_abs_epi8(wv);
    const float d0 = a.d[n * nh + 2 * b], d1 = a.d[n * nh + 2 * b + 1];
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const float dx = a.x8_scale[r * nb + b];
      __m256i isum = lane_sums(wabs, wv, a.x8 + r * K + b * kBlock);
      if (a.x8_lo)
        isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 8), lane_sums(wabs, wv, a.x8_lo + r * K + b * kBlock));
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(d1 * dx), _mm_set1_ps(d0 * dx));
      acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, acc[i]);
    float out = hsum8(lanes);
    if (a.m) {
      // the eight offset chains (s16.h): half h in lane h % 8
      const float* m = a.m + n * nh;
      const float* xs = s.xs + r * nh;
      __m256 tv = _mm256_setzero_ps();
      int64_t h = 0;
      for (; h + kLanes <= nh; h += kLanes) tv = _mm256_fmadd_ps(_mm256_loadu_ps(m + h), _mm256_loadu_ps(xs + h), tv);
      alignas(32) float t[kLanes];
      _mm256_store_ps(t, tv);
      for (; h < nh; ++h)
        t[h % kLanes] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(m[h]), _mm_set_ss(xs[h]), _mm_set_ss(t[h % kLanes])));
      out = out + hsum8(t);
    }
    a.out[r * a.N + n] = out;
  }
}

}  // namespace

// Tiles of x rows outside, the chunk's weight rows inside: a tile's codes
// stay in L1 while the chunk's rows (kI8ChunkRows x K bytes) sit in L2.
void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  const int64_t M = s.a->M;
  int64_t r = 0;
  for (; r + kRowsPerTile <= M; r += kRowsPerTile)
    for (int64_t n = n0; n < n1; ++n) tile<kRowsPerTile>(s, r, n);
  for (int64_t n = n0; n < n1; ++n) switch (M - r) {
      case 3: tile<3>(s, r, n); break;
      case 2: tile<2>(s, r, n); break;
      case 1: tile<1>(s, r, n); break;
      default: break;
    }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
