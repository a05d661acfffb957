// AVX-512 (F/BW/VL/DQ) build of the attention kernel; only called when the
// CPU reports those features (dispatch.cpp).
#include <immintrin.h>

#include "attention/kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports its own AVX-512 intrinsic headers (the deliberately undefined
// pass-through operand __Y) as (maybe-)uninitialized: GCC bug 105593.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace paged::cpu::attn::isa_avx512 {
#include "attention/vec_avx512.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#else
namespace paged::cpu::attn::isa_avx512 {
void attention(const AttnArgs& a) { isa_scalar::attention(a); }
}  // namespace paged::cpu::attn::isa_avx512
#endif
