// Python-facing operations of the CPU attention backend. Each validates its
// arguments once (tensor_args.h) and then runs without further checks.
#pragma once

#include <string>
#include <vector>

#include "attention/tensor_args.h"

namespace paged::cpu::attn {

void paged_attention(Array out, Array query, Array key_cache, Array value_cache, Array block_tables,
                     Array seq_lens, double scale, int64_t sliding_window);
void prefill_attention(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                       Array seq_lens, Array block_tables, double scale, int64_t sliding_window);

// prefill_attention on AMX-BF16 tiles, q, k, v and the probabilities in
// bfloat16 (attention/prompt_bf16.h): what mixed-bf16 runs for prompt rows.
// float32 / bfloat16 / float16 caches, head sizes a multiple of 32; where
// bf16_prompt_attention_supported() is false it raises.
void prefill_attention_bf16(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                            Array seq_lens, Array block_tables, double scale, int64_t sliding_window);
bool bf16_prompt_attention_supported();
// Whether prefill_attention_bf16 runs here over this cache (a float dtype, a
// head size it takes): the one test of where prompt rows take it.
bool bf16_prompt_attention_reads(Array key_cache);

// prefill_attention with the query vectors in the AVX-512 lanes, float32
// (attention/prompt_lanes.h): what mixed runs for prompt rows on AVX-512 CPUs.
// float32 / bfloat16 / float16 caches; where lanes_prompt_attention_supported()
// is false (no AVX-512, or a lower attention ISA chosen) it raises.
void prefill_attention_lanes(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                             Array seq_lens, Array block_tables, double scale, int64_t sliding_window);
bool lanes_prompt_attention_supported();
// Whether prefill_attention_lanes runs here over this cache (a float dtype).
bool lanes_prompt_attention_reads(Array key_cache);

void reshape_and_cache(Array key, Array value, Array key_cache, Array value_cache, Array slot_mapping);
void read_kv(Array key_cache, Array value_cache, Array slot_mapping, Array key_out, Array value_out);
void copy_blocks(const std::vector<Array>& key_caches, const std::vector<Array>& value_caches, Array block_mapping);
void swap_blocks(Array src_cache, Array dst_cache, Array block_mapping);
// out[i] = float8_e4m3fn(x[i]): the cache's own conversion (kernel_common.h), exposed for its tests.
void to_fp8_e4m3fn(Array x, Array out);

// Kernel ISA: "avx512", "avx2" or "scalar". set_isa("auto") picks the best the CPU has.
std::string current_isa();
void set_isa(const std::string& name);
std::vector<std::string> supported_isas();

}  // namespace paged::cpu::attn
