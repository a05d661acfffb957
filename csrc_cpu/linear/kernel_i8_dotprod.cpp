// Dot-product (ARMv8.2 sdot) build of the int8 path (shared body:
// kernel_i8_neon.inc), as llama.cpp's q8 dot products on aarch64: 4 signed
// bytes times 4 signed bytes summed into each int32 lane, exact. Compiled
// for aarch64 only, with the extension enabled for this file's functions
// alone (headers are included first and stay baseline), and chosen only
// where HWCAP reports asimddp (Cortex-A55/A76, Neoverse N1 and later, Apple M1).
#include <arm_neon.h>

#include <algorithm>

#include "linear/neon_panel.h"

#if defined(__clang__)  // Apple clang (macOS): the same, as a function attribute
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

namespace paged::cpu::linear::isa_dotprod {
namespace {

inline int32x4_t dot32(const int8_t* w, int8x16_t x0, int8x16_t x1) {
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(w), x0), vld1q_s8(w + 16), x1);
}

}  // namespace

#include "linear/kernel_i8_neon.inc"

}  // namespace paged::cpu::linear::isa_dotprod

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
