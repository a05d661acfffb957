// Plain Advanced SIMD build of the int8 path (shared body: kernel_i8_neon.inc),
// for aarch64 cores without the dot-product extension (Cortex-A53/A72, the
// Raspberry Pi 3/4): a block's products by smull (int8 x int8 -> int16; two
// products per int16 lane stay below 2^15) and pairwise accumulation into
// int32 (sadalp). Also the quantizer of x for every NEON build: the scalar
// one (bitwise the definition, once per row).
#include <arm_neon.h>

#include <algorithm>

#include "arch/arm/linear/neon_panel.h"

namespace paged::cpu::linear::isa_neon {
namespace {

inline int32x4_t dot32(const int8_t* w, int8x16_t x0, int8x16_t x1) {
  const int8x16_t w0 = vld1q_s8(w), w1 = vld1q_s8(w + 16);
  int32x4_t s = vpaddlq_s16(vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0));
  return vpadalq_s16(s, vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)), w1, x1));
}

}  // namespace

#include "arch/arm/linear/kernel_i8_neon.inc"

}  // namespace paged::cpu::linear::isa_neon
