// Float32 attention of prompt rows with the query vectors in the SIMD lanes
// (what --linear-activations mixed runs for a prompt's rows on AVX-512 CPUs
// without AMX; docs/kernels.md, "Lane-major prompt attention"). Defined per
// query vector over its visible keys in steps of 32 keys at absolute
// positions:
//   s_j = sum over d, in order, of fma(q_d * scale, k_jd, .) from 0
//   out = sum_j p_j v_j / sum_j p_j,  p_j = exp(s_j - m)
// with m a running max that moves only when a step's max exceeds it by more
// than 8, and every sum sequential (keys in order). A vector's result
// depends on its own query, keys and values only (any chunking, batch,
// thread count); it is not bitwise the float32 kernel's (whose scores sum
// 16 lanes of d), which the decode rows keep.
#pragma once

#include "attention/kernel_common.h"

// Compiled for x86-64 (arch/x86/attention/prompt_lanes_avx512.cpp); where
// it runs: kernel_builds.h (lanes_prompt_attention).
namespace paged::cpu::attn::isa_avx512_lanes {

// Cache dtypes it reads: float32, bfloat16, float16 (int8 / fp8 rows are the float32 kernel's).
inline bool reads_cache(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
// Prefill attention of `a` (checked as prefill_attention's arguments; cache dtype as above).
void prompt_attention(const AttnArgs& a);

}  // namespace paged::cpu::attn::isa_avx512_lanes
