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
#include <cstring>
#include <utility>

#include "linear/int8.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace paged::cpu::linear::isa_avx2 {
namespace {

struct Dot {
  static constexpr bool kQ8Biased = false;  // q8 codes stay signed (see above)

  // isum[r][j] = block sums of x rows x[r] (one block each) with panel
  // column j at w (block b, the tile's first column; a step's columns are
  // step_bytes apart); corr[r] as in int8.h.
  template <QType T, int R, int J>
  static void block(const uint8_t* w, int64_t step_bytes, const int8_t* const x[R], const int32_t corr[R],
                    __m256i isum[R][J]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_si256();
    for (int s = 0; s < kBlock / 4; ++s) {
      __m256i wv[J], wabs[J];
      for (int j = 0; j < J; ++j) {
        wv[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + s * step_bytes + j * 32));
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

#include "linear/kernel_i8_ymm.inc"

}  // namespace paged::cpu::linear::isa_avx2

#pragma GCC pop_options
