// The decoder layers of one CPU step in one extension call (issue #5/#6),
// executing each layer's description (core/models/spec.py LayerSpec, handed
// over by backends/cpu/layer_stack.py as a LayerShape): RMSNorm before
// attention and MLP, optional RMSNorms of the attention and MLP outputs
// before their residual adds (Gemma 3), optional per-head Q/K RMSNorm
// (Qwen3, Gemma 3), a Q/K/V bias, a SiLU- or GELU-tanh-gated MLP, the
// layer's own rotary table (any base or scaling, partial rotary: its width
// says how many dims rotate), sliding window and attention scale.
//
// LayerStack holds every layer's weights (nanobind ndarrays that keep the
// Python tensors alive) and scratch buffers sized by the step's token count,
// and runs the same kernel entry points, with the same arguments and in the
// same order, as the Python path (core/models/decoder.py DecoderLayer.forward
// with CpuFusedLayerOps and CpuBackend), so its results are bitwise
// identical; what it saves is Python dispatch, DLPack capsules and torch
// allocations.
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
#include "model/moe_experts.h"

namespace paged::cpu::model {

using Array = nanobind::ndarray<>;

// (qtype, qs, d, m) of one packed GGUF matrix, as linear::quant_linear takes it.
using PackedMatrix = std::tuple<std::string, Array, Array, std::optional<Array>>;

// A stack's matrix and, optionally, its persistent int8 weight panels
// (linear/weight_panels.h), passed to quant_linear while they match the
// active linear build (else the kernel builds its panels per call, same bits).
// parts: the matrix's row groups in order (one, or a fused QKV whose Q/K and
// V rows come in different layouts, core/models/loaders/packed.py
// PackedParts), each run by its own call with its own panels (one per part).
struct StackMatrix {
  std::vector<PackedMatrix> parts;
  std::vector<std::optional<Array>> panels;
};

struct StackConfig {
  int64_t num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size;
  double eps, scale;  // the final norm's eps; a layer's defaults (LayerShape)
  int64_t sliding_window;
};

enum class Activation { SiLU, GeluTanh };

// What one layer adds to the Llama layer (core/models/spec.py LayerSpec);
// unset values take the stack's (StackConfig) or run()'s rotary table.
struct LayerShape {
  std::optional<double> eps;           // every norm of the layer over hidden rows
  std::optional<double> qk_eps;        // the per-head Q/K norms' (default: eps)
  std::optional<double> scale;         // attention scale
  std::optional<int64_t> sliding_window;
  std::string activation = "silu";     // of the gate: "silu" or "gelu_tanh"
  std::optional<Array> attn_out_norm;  // [hidden]: RMSNorm of o_proj's output before the residual add
  std::optional<Array> mlp_out_norm;   // [hidden]: of down's output
  std::optional<Array> q_norm, k_norm; // [head_dim]: per-head RMSNorm of Q and K before the rotation
  std::optional<Array> cos_sin;        // float32 [max_pos, R]: the layer's rotary table
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
  // O, gate/up and down projections (else two). shape: what the layer adds
  // to the Llama layer, checked here. qkv: its row parts (StackMatrix);
  // with several, qkv_part_panels: none or one per part (panels' qkv entry
  // is then None). mlp: in place of gate_up and down (both None), a Python
  // callable mlp(x, first_prompt_row) -> [T, hidden] float32 for the
  // layer's MLP (a mixture of experts: MoeMlp.__call__),
  // called with the GIL on x [T, hidden], a tensor over the stack's scratch
  // valid for the call (first_prompt_row: run()'s, None for -1). moe (with
  // mlp): the layer's MoeExperts with its router set, whose forward() runs
  // in mlp's place while ready() (the same bits: mlp's own path calls
  // ops::moe_route and the same experts).
  void add_layer(Array input_norm, Array post_norm, std::vector<PackedMatrix> qkv, std::optional<Array> qkv_bias,
                 PackedMatrix o_proj, std::optional<PackedMatrix> gate_up, std::optional<PackedMatrix> down,
                 std::vector<std::optional<Array>> panels = {}, bool one_term = false, LayerShape shape = {},
                 std::vector<std::optional<Array>> qkv_part_panels = {},
                 std::optional<nanobind::callable> mlp = std::nullopt,
                 std::optional<nanobind::object> moe = std::nullopt);

  // Binds one (key_cache, value_cache) pair per layer for the following runs.
  void bind_kv_caches(const std::vector<std::tuple<Array, Array>>& kv_caches);

  // All layers plus the final add + RMSNorm of one step. hidden [T, hidden]
  // (the embedding rows) becomes the residual; out [T, hidden] receives the
  // final normed hidden states. positions int64 [T] and cos_sin float32 are
  // CpuFusedLayerOps.rope_inputs (cos_sin: the table of layers added without
  // their own); the rest is AttentionMetadata.
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
    double eps, qk_eps, scale;
    int64_t sliding_window;
    Activation activation;
    std::optional<Array> attn_out_norm, mlp_out_norm, q_norm, k_norm, cos_sin;
    std::optional<nanobind::callable> mlp;  // the layer's MLP in Python, in place of gate_up / down
    nanobind::object moe_owner;             // keeps moe alive
    MoeExperts* moe = nullptr;              // that MLP in C++ (add_layer's moe)
  };
  // x [T, hidden] = mlp(x) (Layer::mlp), the result checked and copied back.
  void python_mlp(const nanobind::callable& mlp, float* x, int64_t tokens) const;

  void linear(const StackMatrix& w, float* x, int64_t rows, int64_t in, float* out, int64_t n,
              int64_t two_term_rows = -1) const;
  void attention(size_t index, int64_t tokens, Array& slot_mapping, Array& seq_lens, Array& block_tables,
                 int64_t num_decodes);
  void layer(size_t index, Array& hidden, float* x, int64_t tokens, Array& positions, Array& cos_sin,
             Array& slot_mapping, Array& seq_lens, Array& block_tables, int64_t num_decodes, int64_t bf16_split);
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
  int64_t first_prompt_row_ = -1;      // this run's (Layer::mlp's argument)
  Scratch qkv_, q_, k_, v_, attn_, gate_up_, act_;
  mutable Scratch part_out_;  // one row part's output before it joins the matrix's (StackMatrix)
  std::vector<int32_t> prefill_starts_;  // query_start_loc[nd:] - nd
};

}  // namespace paged::cpu::model
