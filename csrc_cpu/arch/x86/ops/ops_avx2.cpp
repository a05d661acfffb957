// AVX2 + FMA build of the fused-op row kernels; chosen only where the CPU
// reports AVX2, FMA and F16C (kernel_builds.cpp), so the module loads anywhere.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "arch/target.h"
#include "ops/row_kernels.h"

PAGED_TARGET_BEGIN("avx2,fma")
namespace paged::cpu::ops::isa_avx2 {
#define PAGED_OPS_ISA "avx2"
#include "ops/kernels.inc"
#undef PAGED_OPS_ISA
}  // namespace paged::cpu::ops::isa_avx2
PAGED_TARGET_END()
