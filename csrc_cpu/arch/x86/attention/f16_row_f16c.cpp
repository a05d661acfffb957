// F16C build of a float16 cache row's write (kernel_common.h): float_to_f16
// on 8 values at a time. F16C's round to nearest even is the same IEEE
// rounding, subnormals and overflow to inf included; a group holding a NaN
// takes the scalar definition (its quiet NaN is sign | 0x7e00, F16C keeps
// payload bits).
#include <immintrin.h>

#include "arch/target.h"
#include "attention/kernel_common.h"

PAGED_TARGET_BEGIN("avx2,f16c")
namespace paged::cpu::attn::isa_avx2 {

void f32_to_f16_row(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (int64_t j = i; j < i + 8; ++j) dst[j] = float_to_f16(src[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = float_to_f16(src[i]);
}

}  // namespace paged::cpu::attn::isa_avx2
PAGED_TARGET_END()
