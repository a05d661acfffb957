// Boundary of the attention kernels: every argument is checked here, once,
// including one pass over the used block-table entries.
#include <cmath>
#include <string>
#include <stdexcept>

#include <nanobind/nanobind.h>

#include "attention/ops.h"
#include "attention/prompt_bf16.h"
#include "attention/prompt_lanes.h"
#include "kernel_builds.h"

namespace nb = nanobind;

namespace paged::cpu::attn {
namespace {

constexpr int64_t kMaxHeadSize = 256;

struct Checked {
  AttnArgs args{};
  TensorArg out, query, key_cache, value_cache, block_tables, seq_lens;
};

// Checks shared by decode and prefill; returns the filled kernel arguments
// (query_start_loc is set by the caller).
Checked check_common(Array& out, Array& query, Array& key_cache, Array& value_cache, Array& block_tables,
                     Array& seq_lens, double scale, int64_t sliding_window) {
  Checked c;
  AttnArgs& a = c.args;
  DType kd, vd, qd, od;
  c.key_cache = cache_tensor("key_cache", key_cache, {-1, -1, -1, -1}, &kd);
  c.value_cache = cache_tensor("value_cache", value_cache, {-1, -1, -1, -1}, &vd);
  require_same_shape(c.key_cache, c.value_cache);
  // an int8 / fp8_e4m3 cache row holds head_size codes and the row's float32 scale
  const int64_t extra = scaled_rows(kd) ? kI8ScaleBytes : 0;
  const int64_t num_blocks = c.key_cache.dim(0), hkv = c.key_cache.dim(1), bs = c.key_cache.dim(2),
                d = c.key_cache.dim(3) - extra;
  if (d % 16 || d < 16 || d > kMaxHeadSize)
    fail(extra ? "head_size (key_cache dim 3 minus the 4 scale bytes of an int8 / fp8_e4m3 cache)" : "head_size (key_cache dim 3)",
         "a multiple of 16 in [16, " + std::to_string(kMaxHeadSize) + "]", d);
  if (bs < 1) fail("block_size (key_cache dim 2)", ">= 1", bs);
  if (hkv < 1) fail("num_kv_heads (key_cache dim 1)", ">= 1", hkv);
  c.query = float_tensor("query", query, {-1, -1, d}, &qd);
  c.out = float_tensor("out", out, {-1, -1, d}, &od);
  require_same_shape(c.query, c.out);
  // the cache may hold another dtype than the query (a bfloat16, int8 or fp8 KV
  // cache under a float32 model); key and value caches, and query and out, agree
  if (vd != kd)
    fail("value_cache", std::string("the dtype of key_cache (") + dtype_name(kd) + ")",
         std::string("dtype ") + dtype_name(vd));
  if (od != qd)
    fail("out", std::string("the dtype of query (") + dtype_name(qd) + ")", std::string("dtype ") + dtype_name(od));
  const int64_t h = c.query.dim(1);
  if (h < 1 || h % hkv)
    fail("num_heads (query dim 1)", "a positive multiple of num_kv_heads (" + std::to_string(hkv) + ")", h);
  c.seq_lens = int_tensor("seq_lens", seq_lens, 32, {-1});
  const int64_t num_seqs = c.seq_lens.dim(0);
  c.block_tables = int_tensor("block_tables", block_tables, 32, {-1, -1});
  require_dim(c.block_tables, 0, num_seqs, "one row per sequence, like seq_lens");
  if (!std::isfinite(scale) || scale == 0.0) fail("scale", "a finite non-zero number", scale);
  if (sliding_window < 0) fail("sliding_window", ">= 0 (0 = unlimited)", sliding_window);

  const int64_t width = c.block_tables.dim(1);
  const auto* lens = static_cast<const int32_t*>(c.seq_lens.data);
  const auto* table = static_cast<const int32_t*>(c.block_tables.data);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    if (len < 1) fail("seq_lens[" + std::to_string(s) + "]", ">= 1", len);
    if (len > width * bs)
      fail("seq_lens[" + std::to_string(s) + "]",
           "<= the block table capacity (" + std::to_string(width) + " blocks x " + std::to_string(bs) + " = " +
               std::to_string(width * bs) + " tokens)",
           len);
    for (int64_t b = 0, used = (len + bs - 1) / bs; b < used; ++b) {
      const int64_t id = table[s * width + b];
      if (id < 0 || id >= num_blocks)
        fail_index("block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "]",
                   "a block id in [0, " + std::to_string(num_blocks) + ")", id);
    }
  }
  a.out = c.out.data;
  a.query = c.query.data;
  a.key_cache = c.key_cache.data;
  a.value_cache = c.value_cache.data;
  a.dtype = qd;
  a.cache_dtype = kd;
  a.num_heads = h;
  a.num_kv_heads = hkv;
  a.head_size = d;
  a.block_size = bs;
  a.block_tables = table;
  a.table_stride = width;
  a.seq_lens = lens;
  a.num_seqs = num_seqs;
  a.scale = float(scale);
  a.sliding_window = sliding_window;
  return c;
}

void run(const AttnArgs& a) {
  nb::gil_scoped_release release;
  run_attention(a);
}

}  // namespace

void paged_attention(Array out, Array query, Array key_cache, Array value_cache, Array block_tables,
                     Array seq_lens, double scale, int64_t sliding_window) {
  Checked c = check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window);
  if (c.query.dim(0) != c.args.num_seqs)
    fail("seq_lens", "one entry per query row (" + std::to_string(c.query.dim(0)) + ")",
         std::to_string(c.args.num_seqs) + " entries (decode takes one query token per sequence)");
  std::vector<int32_t> starts(size_t(c.args.num_seqs + 1));
  for (size_t i = 0; i < starts.size(); ++i) starts[i] = int32_t(i);
  c.args.query_start_loc = starts.data();
  run(c.args);
}

namespace {

// prefill_attention's checks: check_common's and query_start_loc's.
Checked check_prefill(Array& out, Array& query, Array& key_cache, Array& value_cache, Array& query_start_loc,
                      Array& seq_lens, Array& block_tables, double scale, int64_t sliding_window) {
  Checked c = check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window);
  const int64_t num_seqs = c.args.num_seqs, num_tokens = c.query.dim(0);
  TensorArg qsl = int_tensor("query_start_loc", query_start_loc, 32, {num_seqs + 1});
  const auto* starts = static_cast<const int32_t*>(qsl.data);
  if (starts[0] != 0 || starts[num_seqs] != num_tokens)
    fail("query_start_loc", "0.." + std::to_string(num_tokens) + " (num_tokens)",
         std::to_string(starts[0]) + ".." + std::to_string(starts[num_seqs]));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q = int64_t(starts[s + 1]) - starts[s];
    if (q < 1 || q > c.args.seq_lens[s])
      fail("query tokens of sequence " + std::to_string(s),
           "in [1, seq_lens[" + std::to_string(s) + "] = " + std::to_string(c.args.seq_lens[s]) + "]", q);
  }
  c.args.query_start_loc = starts;
  return c;
}

}  // namespace

void prefill_attention(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                       Array seq_lens, Array block_tables, double scale, int64_t sliding_window) {
  run(check_prefill(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                    sliding_window).args);
}

bool bf16_prompt_attention_supported() { return bf16_prompt_attention() != nullptr; }

bool bf16_prompt_attention_reads(Array key_cache) {
  if (!bf16_prompt_attention_supported()) return false;
  DType t;
  const TensorArg k = cache_tensor("key_cache", key_cache, {-1, -1, -1, -1}, &t);
  return isa_amx_bf16::reads_cache(t) && isa_amx_bf16::takes_head_size(k.dim(3));
}

void prefill_attention_bf16(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                            Array seq_lens, Array block_tables, double scale, int64_t sliding_window) {
  Checked c = check_prefill(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                            sliding_window);
  if (!isa_amx_bf16::reads_cache(c.args.cache_dtype))
    fail("key_cache", "float32, bfloat16 or float16 (the bfloat16 prompt attention reads no int8 / fp8 rows)",
         std::string("dtype ") + dtype_name(c.args.cache_dtype));
  if (!isa_amx_bf16::takes_head_size(c.args.head_size))
    fail("head_size (key_cache dim 3)", "a multiple of 32 for the bfloat16 prompt attention", c.args.head_size);
  const AttentionKernel kernel = bf16_prompt_attention();
  if (!kernel)
    throw std::runtime_error("prefill_attention_bf16: this CPU (or OS) offers no AMX-BF16 tiles; "
                             "bf16_prompt_attention_supported() says where it runs");
  nb::gil_scoped_release release;
  kernel(c.args);
}

bool lanes_prompt_attention_supported() { return lanes_prompt_attention() != nullptr; }

bool lanes_prompt_attention_reads(Array key_cache) {
  if (!lanes_prompt_attention_supported()) return false;
  DType t;
  cache_tensor("key_cache", key_cache, {-1, -1, -1, -1}, &t);
  return isa_avx512_lanes::reads_cache(t);
}

void prefill_attention_lanes(Array out, Array query, Array key_cache, Array value_cache, Array query_start_loc,
                             Array seq_lens, Array block_tables, double scale, int64_t sliding_window) {
  Checked c = check_prefill(out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                            sliding_window);
  if (!isa_avx512_lanes::reads_cache(c.args.cache_dtype))
    fail("key_cache", "float32, bfloat16 or float16 (the lane-major prompt attention reads no int8 / fp8 rows)",
         std::string("dtype ") + dtype_name(c.args.cache_dtype));
  const AttentionKernel kernel = lanes_prompt_attention();
  if (!kernel)
    throw std::runtime_error("prefill_attention_lanes: needs the avx512 attention build (this CPU has no AVX-512, "
                             "or a lower ISA is chosen); lanes_prompt_attention_supported() says where it runs");
  nb::gil_scoped_release release;
  kernel(c.args);
}

}  // namespace paged::cpu::attn
