// Baseline build of the fused-op row kernels (the compiler's default ISA).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/row_kernels.h"

namespace paged::cpu::ops::isa_scalar {
#define PAGED_OPS_ISA "scalar"
#include "ops/kernels.inc"
#undef PAGED_OPS_ISA
}  // namespace paged::cpu::ops::isa_scalar
