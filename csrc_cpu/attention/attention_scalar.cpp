// Portable build of the attention kernel (any x86-64 or other CPU).
#include "attention/kernel_common.h"

namespace paged::cpu::attn::isa_scalar {
#include "attention/vec_scalar.inc"
#include "attention/kernel_impl.inc"

void f32_to_f16_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}
}  // namespace paged::cpu::attn::isa_scalar
