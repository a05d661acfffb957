// Advanced SIMD (NEON) build of the attention kernel, compiled for aarch64
// only (csrc_cpu/CMakeLists.txt); chosen where the CPU reports asimd
// (dispatch, kernel_builds.cpp), i.e. every ARMv8-A core.
#include <arm_neon.h>

#include "attention/kernel_common.h"

namespace paged::cpu::attn::isa_neon {
#include "arch/arm/attention/vec_neon.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_neon
