// AVX2 + FMA build of the fused-op row kernels; chosen at run time only when
// the CPU reports both (fused_ops.cpp), so the module still loads anywhere.
#include <cmath>
#include <cstring>
#include <limits>

#include "ops/ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace paged::cpu::ops::isa_avx2 {
#define PAGED_OPS_ISA "avx2"
#include "ops/kernels.inc"
#undef PAGED_OPS_ISA
}  // namespace paged::cpu::ops::isa_avx2
#pragma GCC pop_options
#else  // never selected off x86 (cpu_has_avx2 is false); built so the table links
namespace paged::cpu::ops::isa_avx2 {
#define PAGED_OPS_ISA "avx2"
#include "ops/kernels.inc"
#undef PAGED_OPS_ISA
}  // namespace paged::cpu::ops::isa_avx2
#endif
