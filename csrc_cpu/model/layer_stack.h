// The decoder layers of one CPU step in one extension call (issue #5/#6).
//
// LayerStack holds every layer's weights (nanobind ndarrays that keep the
// Python tensors alive) and scratch buffers sized by the step's token count,
// and runs the same kernel entry points, with the same arguments and in the
// same order, as the Python path (LlamaDecoderLayer.forward with
// CpuFusedLayerOps and CpuBackend), so its results are bitwise identical;
// what it saves is Python dispatch, DLPack capsules and torch allocations.
//
// `activations` is the packed linear's setting for every matrix of the stack
// ("float32", "int8" or "int8x2", linear/quant_linear.h), the same the Python
// path's CpuPackedLinear objects carry, so the two stay bitwise equal in every
// mode; or "mixed": int8 for every row of the O, gate/up and down
// projections of the layers added with one_term (the middle layers:
// backends/cpu/quant_linear.py one_term_layers), int8x2 everywhere else, QKV
// included (docs/kernels.md, "Mixed activations"); a row's arithmetic
// depends on its layer and matrix only, not on its role; or
// "mixed-bf16": int8x2 for the rows that generate a token, bfloat16 on AMX
// tiles (linear/bf16_prompt.h) for every prompt row, QKV's included
// (quant_linear's prompt_rows "bf16").
//
// Not thread-safe: one engine thread owns a stack (the scratch and the bound
// KV caches are shared state). Call run() with the GIL held: the kernels it
// calls release the GIL themselves.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "linear/aligned.h"

namespace paged::cpu::model {

using Array = nanobind::ndarray<>;

// (qtype, qs, d, m) of one packed GGUF matrix, as linear::quant_linear takes it.
using PackedMatrix = std::tuple<std::string, Array, Array, std::optional<Array>>;

// A stack's matrix and, optionally, its persistent int8 weight panels
// (linear/weight_panels.h), passed to quant_linear while they match the
// active linear build (else the kernel builds its panels per call, same bits).
struct StackMatrix {
  PackedMatrix w;
  std::optional<Array> panels;
};

struct StackConfig {
  int64_t num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size;
  double eps, scale;
  int64_t sliding_window;
};

// float32 scratch, 64-byte aligned like torch's allocations.
using Scratch = AlignedVector<float>;

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
             int64_t intermediate_size, double eps, double scale, int64_t sliding_window, Array final_norm,
             std::string activations = "float32");

  // Appends one decoder layer (weights checked by the kernels on every run;
  // the bias, which this class adds itself, is checked here). panels: none,
  // or one per matrix (qkv, o_proj, gate_up, down; each None or
  // build_weight_panels' tensor of that matrix, checked by quant_linear).
  // one_term ("mixed" only): every row takes one int8 term in this layer's
  // O, gate/up and down projections (else two).
  void add_layer(Array input_norm, Array post_norm, PackedMatrix qkv, std::optional<Array> qkv_bias,
                 PackedMatrix o_proj, PackedMatrix gate_up, PackedMatrix down,
                 std::vector<std::optional<Array>> panels = {}, bool one_term = false);

  // Binds one (key_cache, value_cache) pair per layer for the following runs.
  void bind_kv_caches(const std::vector<std::tuple<Array, Array>>& kv_caches);

  // All layers plus the final add + RMSNorm of one step. hidden [T, hidden]
  // (the embedding rows) becomes the residual; out [T, hidden] receives the
  // final normed hidden states. positions int64 [T] and cos_sin float32 are
  // CpuFusedLayerOps.rope_inputs; the rest is AttentionMetadata.
  void run(Array hidden, Array out, Array positions, Array cos_sin, Array slot_mapping, Array query_start_loc,
           Array seq_lens, Array block_tables, int64_t num_decodes, int64_t first_prompt_row = -1);

  size_t num_layers() const { return layers_.size(); }
  size_t num_bound_caches() const { return kv_caches_.size(); }
  const std::string& activations() const { return activations_; }

 private:
  struct Layer {
    Array input_norm, post_norm;
    StackMatrix qkv, o_proj, gate_up, down;
    std::optional<Array> qkv_bias;
    bool one_term = false;
  };

  void linear(const StackMatrix& w, float* x, int64_t rows, int64_t in, float* out, int64_t n,
              int64_t two_term_rows = -1) const;
  void attention(size_t index, int64_t tokens, Array& slot_mapping, Array& seq_lens, Array& block_tables,
                 int64_t num_decodes);
  void reserve(int64_t tokens);
  // The kernel of this run's prompt rows over the bound caches: mixed-bf16's
  // bfloat16 one (attn::bf16_prompt_attention_reads), mixed's lane-major
  // float32 one (attn::lanes_prompt_attention_reads), or the shared kernel.
  using PrefillOp = void (*)(Array, Array, Array, Array, Array, Array, Array, double, int64_t);
  PrefillOp prompt_attention_op(int64_t split) const;  // split: the first marked prompt row, -1 for none

  StackConfig cfg_;
  Array final_norm_;
  std::string activations_;  // the packed linear's activations (or "mixed"), checked at construction
  std::string linear_activations_;  // what quant_linear is called with ("mixed", "mixed-bf16" -> "int8x2")
  std::string prompt_rows_ = "int8";  // quant_linear's prompt_rows ("mixed-bf16" -> "bf16")
  std::vector<Layer> layers_;
  std::vector<std::tuple<Array, Array>> kv_caches_;
  std::vector<int32_t> part_starts_;  // query_start_loc of one part of the prefill sequences
  int64_t prompt_seq_ = 0;             // this run's first sequence on prompt_op_ (ns: none)
  PrefillOp prompt_op_ = nullptr;
  int64_t capacity_ = 0;               // token rows the scratch holds
  Scratch qkv_, q_, k_, v_, attn_, gate_up_, act_;
  std::vector<int32_t> prefill_starts_;  // query_start_loc[nd:] - nd
};

}  // namespace paged::cpu::model
