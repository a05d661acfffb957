// AVX2 widening of compact scales (linear/compact_scales.h): per 8 scales
// one sign extension, one conversion and one multiply by the broadcast
// super value. The same IEEE products as the scalar loop (a multiply, never
// fused), so bitwise its values; ~8x fewer instructions, which batch-1
// decode pays for every scale of every matrix per token.
#include <immintrin.h>

#include <cstring>

#include "arch/target.h"
#include "linear/compact_scales.h"

PAGED_TARGET_BEGIN("avx2,f16c")

namespace paged::cpu::linear::isa_avx2 {

void widen_compact(const uint8_t* c, int64_t scales, int64_t K, int64_t n0, int64_t n1, float* out) {
  const int64_t row_bytes = compact_row_bytes(scales, K), supers = K / kCompactWeights, per = scales / supers;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = c + n * row_bytes;
    float* dst = out + n * scales;
    for (int64_t g = 0; g < supers; ++g) {
      float super;
      std::memcpy(&super, row + scales + 4 * g, sizeof super);
      const __m256 s = _mm256_set1_ps(super);
      for (int64_t i = g * per; i < (g + 1) * per; i += 8) {  // per is 8 or 16
        const __m256i bytes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes), s));
      }
    }
  }
}

// s16's fp16 half-pair scales (compact_scales.h, widen_half_pair_rows): 8
// values converted at once, each duplicated for its block's two halves.
void widen_half_pairs(const uint16_t* h, int64_t nb, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* src = h + n * nb;
    float* dst = out + n * 2 * nb;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b)));
      const __m256 lo = _mm256_unpacklo_ps(v, v), hi = _mm256_unpackhi_ps(v, v);  // per 128-bit lane: 0 0 1 1 | 4 4 5 5
      _mm256_storeu_ps(dst + 2 * b, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(dst + 2 * b + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
    for (; b < nb; ++b) dst[2 * b] = dst[2 * b + 1] = _cvtsh_ss(src[b]);
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
