// AVX2 + FMA + F16C build of the attention kernel; chosen only where the CPU
// reports those features (kernel_builds.cpp), so the module loads anywhere.
#include <immintrin.h>

#include "arch/target.h"
#include "attention/kernel_common.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")
namespace paged::cpu::attn::isa_avx2 {
#include "arch/x86/attention/vec_avx2.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_avx2
PAGED_TARGET_END()
