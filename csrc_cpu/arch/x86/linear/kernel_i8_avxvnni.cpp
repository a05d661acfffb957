// AVX-VNNI build of the int8 path (int8.h; shared body and layout in
// kernel_i8_ymm.inc): a block's exact int32 sums for 8 weight rows per vector
// from VEX vpdpbusd (unsigned codes, q8 codes + 128, times signed x codes;
// the accumulator starts at int8.h's corr). Selected where CPUID reports
// AVX-VNNI but not AVX512_VNNI (Alder Lake and later, Zen 5, or an AVX-512
// CPU with PAGED_CPU_HIDE=avx512vnni).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "arch/target.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c,avxvnni")

namespace paged::cpu::linear::isa_avxvnni {
namespace {

struct Dot {
  static constexpr bool kPairTiles = false;  // int8x2 pair tiles (int8.h): none here, no CPU to test them
  static constexpr bool kQ8Biased = true;  // q8 codes + 128, corrected by corr

  // isum[r][j] = block sums of x rows x[r] (one block each) with weight
  // column j, whose step s (codes 4s .. 4s+3 of 8 rows) is w(s, j); corr[r]
  // as in int8.h.
  template <QType T, int R, int J, class W>
  static void block(W w, const int8_t* const x[R], const int32_t corr[R], __m256i isum[R][J]) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) isum[r][j] = T == QType::Q4_1 ? _mm256_setzero_si256() : _mm256_set1_epi32(corr[r]);
    for (int s = 0; s < kBlock / 4; ++s) {
      __m256i wv[J];
      for (int j = 0; j < J; ++j) wv[j] = w(s, j);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, x[r] + 4 * s, sizeof x4);
        const __m256i xb = _mm256_set1_epi32(x4);
        for (int j = 0; j < J; ++j) isum[r][j] = _mm256_dpbusd_avx_epi32(isum[r][j], wv[j], xb);
      }
    }
  }
};

}  // namespace

#include "arch/x86/linear/kernel_i8_ymm.inc"

}  // namespace paged::cpu::linear::isa_avxvnni

PAGED_TARGET_END()
