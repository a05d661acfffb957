// AVX2 build of the int8 path (int8.h; shared body and layout in
// kernel_i8_ymm.inc): a block's exact int32 sums for 8 weight rows per vector
// from vpmaddubsw (unsigned codes x signed x codes, pairs summed to int16) and
// vpmaddwd by ones (pairs of int16 to int32).
//  - 4-bit codes (0..15): 8 steps accumulate in int16 before one vpmaddwd;
//    a lane then sums 16 products, |sum| <= 16 * 15 * 127 = 30480 < 2^15.
//  - q8_0 codes (-128..127) would saturate vpmaddubsw with the +128 bias, so
//    the panel keeps them signed and each step multiplies |w| by x * sign(w)
//    (vpabsb, vpsignb: pairs <= 2 * 128 * 127 = 32512), widened every step.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "arch/target.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")

namespace paged::cpu::linear::isa_avx2 {
namespace {

struct Dot {
  static constexpr bool kPairTiles = true;  // int8x2 pair tiles with x16 (int8.h)
  static constexpr bool kQ8Biased = false;  // q8 codes stay signed (see above)

  // isum[r][j] = block sums of x rows x[r] (one block each) with weight
  // column j, whose step s (codes 4s .. 4s+3 of 8 rows) is w(s, j); corr[r]
  // as in int8.h.
  template <QType T, int R, int J, class W>
  static void block(W w, const int8_t* const x[R], const int32_t corr[R], __m256i isum[R][J]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_si256();
    for (int s = 0; s < kBlock / 4; ++s) {
      __m256i wv[J], wabs[J];
      for (int j = 0; j < J; ++j) {
        wv[j] = w(s, j);
        if constexpr (T == QType::Q8_0) wabs[j] = _mm256_abs_epi8(wv[j]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, x[r] + 4 * s, sizeof x4);
        const __m256i xb = _mm256_set1_epi32(x4);
        for (int j = 0; j < J; ++j) {
          if constexpr (T == QType::Q8_0)
            acc[r][j] = _mm256_add_epi32(
                acc[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], _mm256_sign_epi8(xb, wv[j])), ones));
          else
            acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(wv[j], xb));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) {
        if constexpr (T == QType::Q8_0)
          isum[r][j] = acc[r][j];
        else if constexpr (T == QType::Q4_0)
          isum[r][j] = _mm256_add_epi32(_mm256_madd_epi16(acc[r][j], ones), _mm256_set1_epi32(corr[r]));
        else
          isum[r][j] = _mm256_madd_epi16(acc[r][j], ones);
      }
  }
};

}  // namespace

#include "arch/x86/linear/kernel_i8_ymm.inc"

// x's blocks quantized as int8.h defines (bitwise the scalar build's; the
// AVX-VNNI build uses it too), 32 values in four vectors: |x| and a
// finiteness test, the maximum, one scalar division for dx, then per vector a
// division, clamp, rounding to nearest even and narrowing packs.
void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs) {
  const int32_t offset = unsigned_offset(t);
  const __m256 limit = _mm256_set1_ps(float(kI8Max)), inf = _mm256_set1_ps(INFINITY);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 0xFF;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      const __m256 abs = _mm256_andnot_ps(sign, v[i]);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(abs, inf, _CMP_LT_OQ));
      amax = _mm256_max_ps(amax, abs);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = finite == 0xFF ? _mm_cvtss_f32(m4) / float(kI8Max) : NAN;
    __m256i q[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_setzero_si256();
      if (scale > 0.f) {
        const __m256 ratio = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], _mm256_set1_ps(scale)), -limit), limit);
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, q[i]);
      }
    }
    // packs interleave 128-bit lanes: dwords (0, 4, 1, 5, ...) of the result hold codes 0-3, 4-7, ...
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
    dx[b] = scale;
    corr[b] = -offset * sum;
    xs[b] = scale * float(sum);
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
