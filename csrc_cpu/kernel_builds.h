// The SIMD builds of the kernel families that have per-ISA bodies (attention,
// quantized linear), best first, for the target architecture: one table,
// read by the run-time selectors (attention/dispatch.cpp, linear/
// quant_linear.cpp) and by the C++ check that runs every build against the
// scalar one (tests/kernel_isa_driver.cpp). Free of nanobind, so the drivers
// link it without Python.
#pragma once

#include <vector>

#include "attention/kernel_common.h"
#include "isa_select.h"
#include "linear/quant_linear.h"

namespace paged::cpu {

using AttentionKernel = void (*)(const attn::AttnArgs&);
using AttentionBuild = IsaSelector<AttentionKernel>::Build;
using LinearBuild = IsaSelector<linear::Kernels>::Build;

// x86-64: avx512, avx2; aarch64: neon; then scalar.
std::vector<AttentionBuild> attention_builds();
// x86-64: avx512 (VNNI), amx (opt-in: never auto), avxvnni, avx2; aarch64: i8mm, dotprod, neon; then scalar.
std::vector<LinearBuild> linear_builds();

}  // namespace paged::cpu
