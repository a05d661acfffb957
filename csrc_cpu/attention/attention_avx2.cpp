// AVX2 + FMA + F16C build of the attention kernel; only called when the CPU
// reports those features (dispatch.cpp), so the module still loads anywhere.
#include <immintrin.h>

#include "attention/kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace paged::cpu::attn::isa_avx2 {
#include "attention/vec_avx2.inc"
#include "attention/kernel_impl.inc"
}  // namespace paged::cpu::attn::isa_avx2
#pragma GCC pop_options
#else
namespace paged::cpu::attn::isa_avx2 {
void attention(const AttnArgs& a) { isa_scalar::attention(a); }
}  // namespace paged::cpu::attn::isa_avx2
#endif
