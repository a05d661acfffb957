// paged._C_cpu attention and KV-cache ops (contract: docs/kernels.md).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "attention/ops.h"
#include "module.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu {
void register_attention(nb::module_& m) {
  namespace a = attn;
  m.def("paged_attention", &a::paged_attention, "out"_a, "query"_a, "key_cache"_a, "value_cache"_a,
        "block_tables"_a, "seq_lens"_a, "scale"_a, "sliding_window"_a = 0,
        "Decode attention: one query token per sequence over its paged K/V.");
  m.def("prefill_attention", &a::prefill_attention, "out"_a, "query"_a, "key_cache"_a, "value_cache"_a,
        "query_start_loc"_a, "seq_lens"_a, "block_tables"_a, "scale"_a, "sliding_window"_a = 0,
        "Varlen causal attention of new tokens over cached prefix + themselves.");
  m.def("prefill_attention_bf16", &a::prefill_attention_bf16, "out"_a, "query"_a, "key_cache"_a, "value_cache"_a,
        "query_start_loc"_a, "seq_lens"_a, "block_tables"_a, "scale"_a, "sliding_window"_a = 0,
        "prefill_attention on AMX-BF16 tiles: q, k, v and the probabilities rounded to bfloat16, float32 sums "
        "(mixed-bf16's prompt rows).");
  m.def("bf16_prompt_attention_supported", &a::bf16_prompt_attention_supported,
        "Whether prefill_attention_bf16 runs here (AMX-BF16 tiles granted by the OS).");
  m.def("bf16_prompt_attention_reads", &a::bf16_prompt_attention_reads, "key_cache"_a,
        "Whether prefill_attention_bf16 runs here over this cache (float32 / bfloat16 / float16, head size a "
        "multiple of 32).");
  m.def("prefill_attention_lanes", &a::prefill_attention_lanes, "out"_a, "query"_a, "key_cache"_a, "value_cache"_a,
        "query_start_loc"_a, "seq_lens"_a, "block_tables"_a, "scale"_a, "sliding_window"_a = 0,
        "prefill_attention with the query vectors in the AVX-512 lanes, float32 (mixed's prompt rows).");
  m.def("lanes_prompt_attention_supported", &a::lanes_prompt_attention_supported,
        "Whether prefill_attention_lanes runs here (the avx512 attention build is the active one).");
  m.def("lanes_prompt_attention_reads", &a::lanes_prompt_attention_reads, "key_cache"_a,
        "Whether prefill_attention_lanes runs here over this cache (float32 / bfloat16 / float16).");
  m.def("reshape_and_cache", &a::reshape_and_cache, "key"_a, "value"_a, "key_cache"_a, "value_cache"_a,
        "slot_mapping"_a, "Write K/V [T, Hkv, D] into cache slots (negative slot = padding).");
  m.def("read_kv", &a::read_kv, "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "key_out"_a, "value_out"_a,
        "Gather K/V of the given slots into key_out/value_out (padding slots read as zeros).");
  m.def("copy_blocks", &a::copy_blocks, "key_caches"_a, "value_caches"_a, "block_mapping"_a,
        "Copy-on-write: block dst <- src in every layer.");
  m.def("swap_blocks", &a::swap_blocks, "src_cache"_a, "dst_cache"_a, "block_mapping"_a,
        "dst_cache[dst] <- src_cache[src] between two CPU tensors.");
  m.def("to_fp8_e4m3fn", &a::to_fp8_e4m3fn, "x"_a, "out"_a,
        "out[i] = float8_e4m3fn(x[i]), the fp8 KV cache's conversion (RNE; saturates at +-448).");
  m.def("attention_isa", &a::current_isa, "SIMD build the attention kernels use now.");
  m.def("set_attention_isa", &a::set_isa, "name"_a, "Choose 'auto', 'avx512', 'avx2' or 'scalar'.");
  m.def("supported_attention_isas", &a::supported_isas, "Kernel builds this CPU can run, best first.");
}
}  // namespace paged::cpu
