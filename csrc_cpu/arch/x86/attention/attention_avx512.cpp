// AVX-512 (F/BW/VL/DQ) build of the attention kernel; chosen only where the
// CPU reports those features (kernel_builds.cpp).
#include <immintrin.h>

#include "arch/target.h"
#include "attention/kernel_common.h"

PAGED_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports its own AVX-512 intrinsic headers (the deliberately undefined
// pass-through operand __Y) as (maybe-)uninitialized: GCC bug 105593.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace paged::cpu::attn::isa_avx512 {
#include "arch/x86/attention/vec_avx512.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_avx512
#pragma GCC diagnostic pop
PAGED_TARGET_END()
