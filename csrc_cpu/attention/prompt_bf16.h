// Attention of prompt rows on AMX-BF16 tiles (what --linear-activations
// mixed-bf16 runs for a prompt's rows; docs/kernels.md, "bfloat16 prompt
// attention"). Defined as softmax(bf16(q * scale) . bf16(k)^T) . bf16(v)
// with the probabilities rounded to bfloat16 before they weigh V and float32
// sums everywhere; a query vector's result depends on its own query, its
// visible keys and values only (any chunking, batch, thread count), like
// the float32 kernel's, but not bitwise equal to it.
#pragma once

#include "attention/kernel_common.h"

// Compiled for x86-64 where the compiler knows AMX
// (arch/x86/amx/prompt_bf16_amx.cpp); where it runs: kernel_builds.h
// (bf16_prompt_attention).
namespace paged::cpu::attn::isa_amx_bf16 {

// Cache dtypes it reads: float32, bfloat16, float16 (int8 / fp8 rows are the float32 kernel's).
inline bool reads_cache(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
// Head sizes it takes: multiples of 32 (a tile's row of bfloat16 pairs).
inline bool takes_head_size(int64_t d) { return d % 32 == 0; }
// Prefill attention of `a` (checked as prefill_attention's arguments; cache
// dtype and head size as above).
void prompt_attention(const AttnArgs& a);

}  // namespace paged::cpu::attn::isa_amx_bf16
