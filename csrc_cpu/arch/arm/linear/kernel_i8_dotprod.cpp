// Dot-product (ARMv8.2 sdot) build of the int8 path (shared body:
// kernel_i8_neon.inc), as llama.cpp's q8 dot products on aarch64: 4 signed
// bytes times 4 signed bytes summed into each int32 lane, exact. Compiled
// for aarch64 only, with the extension enabled for this file's functions
// alone (headers are included first and stay baseline), and chosen only
// where HWCAP reports asimddp (Cortex-A55/A76, Neoverse N1 and later, Apple M1).
#include <arm_neon.h>

#include <algorithm>

#include "arch/arm/linear/neon_panel.h"
#include "arch/target.h"

PAGED_TARGET_BEGIN(PAGED_TARGET_ARM_DOTPROD)

namespace paged::cpu::linear::isa_dotprod {
namespace {

inline int32x4_t dot32(const int8_t* w, int8x16_t x0, int8x16_t x1) {
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(w), x0), vld1q_s8(w + 16), x1);
}

}  // namespace

#include "arch/arm/linear/kernel_i8_neon.inc"

}  // namespace paged::cpu::linear::isa_dotprod

PAGED_TARGET_END()
