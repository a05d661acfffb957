#include "model/layer_stack.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "attention/ops.h"
#include "attention/tensor_args.h"
#include "linear/ops.h"
#include "linear/weight_panels.h"
#include "ops/ops.h"

namespace nb = nanobind;

namespace paged::cpu::model {
namespace {

using attn::fail;
using attn::positive;

// An unowned ndarray over memory the caller keeps alive for the call.
Array view(const void* data, std::initializer_list<size_t> shape, nb::dlpack::dtype dtype) {
  return Array(const_cast<void*>(data), shape.size(), shape.begin(), nb::handle(), nullptr, dtype,
               nb::device::cpu::value);
}

Array f32(const float* data, std::initializer_list<size_t> shape) { return view(data, shape, nb::dtype<float>()); }

// One matrix of a layer, or none (a layer whose MLP runs in Python).
StackMatrix matrix_of(std::optional<PackedMatrix> w, std::optional<Array> panels) {
  if (!w) return {};
  return {{std::move(*w)}, {std::move(panels)}};
}

std::string str(int64_t v) { return std::to_string(v); }

// A float32 tensor of `shape` (entries < 0 free): the stack runs float32 models only.
attn::TensorArg f32_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape) {
  attn::DType dt;
  attn::TensorArg t = attn::float_tensor(name, a, shape, &dt);
  if (dt != attn::DType::F32)
    fail(name, "dtype float32 (the stack runs float32 models)", std::string("dtype ") + attn::dtype_name(dt));
  return t;
}

}  // namespace

LayerStack::LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
                       int64_t intermediate_size, double eps, double scale, int64_t sliding_window,
                       Array final_norm, std::string activations)
    : cfg_{positive("num_heads", num_heads),
           positive("num_kv_heads", num_kv_heads),
           positive("head_dim", head_dim),
           positive("hidden_size", hidden_size),
           positive("intermediate_size", intermediate_size),
           eps,
           scale,
           sliding_window},
      final_norm_(std::move(final_norm)),
      activations_(std::move(activations)) {
  if (activations_ == "mixed" || activations_ == "mixed-bf16") {  // int8x2 but where a layer says one term (header)
    linear_activations_ = "int8x2";
    if (activations_ == "mixed-bf16") prompt_rows_ = "bf16";
  } else if (activations_ == "float32" || activations_ == "int8" || activations_ == "int8x2") {
    linear_activations_ = activations_;
  } else {
    fail("activations", "'float32', 'int8', 'int8x2', 'mixed' or 'mixed-bf16'", "'" + activations_ + "'");
  }
  if (num_heads % num_kv_heads)
    fail("num_heads", "a multiple of num_kv_heads (" + str(num_kv_heads) + ")", num_heads);
  if (sliding_window < 0) fail("sliding_window", ">= 0 (0 = unlimited)", sliding_window);
  f32_tensor("final_norm", final_norm_, {hidden_size});
}

void LayerStack::add_layer(Array input_norm, Array post_norm, std::vector<PackedMatrix> qkv, std::optional<Array> qkv_bias,
                           PackedMatrix o_proj, std::optional<PackedMatrix> gate_up, std::optional<PackedMatrix> down,
                           std::vector<std::optional<Array>> panels, bool one_term, LayerShape shape,
                           std::vector<std::optional<Array>> qkv_part_panels, std::optional<nb::callable> mlp,
                           std::optional<nb::object> moe) {
  const auto& c = cfg_;
  if (one_term && activations_ != "mixed")
    fail("one_term", "false unless the stack's activations are 'mixed'", "true with activations '" + activations_ + "'");
  f32_tensor("input_norm", input_norm, {c.hidden_size});
  f32_tensor("post_norm", post_norm, {c.hidden_size});
  if (qkv_bias) f32_tensor("qkv_bias", *qkv_bias, {(c.num_heads + 2 * c.num_kv_heads) * c.head_dim});
  if (!panels.empty() && panels.size() != 4)
    fail("panels", "none or 4 (qkv, o_proj, gate_up, down)", int64_t(panels.size()));
  panels.resize(4);
  const int64_t qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  int64_t rows = 0;
  for (const auto& part : qkv) rows += int64_t(std::get<1>(part).ndim() ? std::get<1>(part).shape(0) : 0);
  if (qkv.empty() || rows != qkv_rows)
    fail("qkv", "row parts of " + str(qkv_rows) + " rows in all", str(int64_t(qkv.size())) + " parts of " + str(rows));
  if (qkv.size() > 1 && panels[0]) fail("panels", "None for a qkv of several row parts", "a tensor");
  if (mlp ? gate_up || down || panels[2] || panels[3] : !gate_up || !down)
    fail("gate_up, down", mlp ? "None (with mlp: the layer's MLP runs in Python), their panels None"
                              : "packed matrices (or mlp given)",
         mlp ? "matrices or panels" : "None");
  MoeExperts* experts = nullptr;
  if (moe) {
    if (!mlp) fail("moe", "None unless mlp is given (the fallback while the experts are not ready)", "experts");
    if (!nb::try_cast(*moe, experts) || !experts) fail("moe", "a MoeExperts", "another object");
    if (experts->hidden_size() != c.hidden_size)
      fail("moe", "experts of hidden size " + str(c.hidden_size), "hidden size " + str(experts->hidden_size()));
  }
  if (!qkv_part_panels.empty() && qkv_part_panels.size() != qkv.size())
    fail("qkv_part_panels", "none or one per qkv row part (" + str(int64_t(qkv.size())) + ")",
         int64_t(qkv_part_panels.size()));
  if (qkv.size() == 1) qkv_part_panels = {std::move(panels[0])};
  qkv_part_panels.resize(qkv.size());
  Activation activation = Activation::SiLU;
  if (shape.activation == "gelu_tanh") activation = Activation::GeluTanh;
  else if (shape.activation != "silu") fail("activation", "'silu' or 'gelu_tanh'", "'" + shape.activation + "'");
  if (shape.attn_out_norm) f32_tensor("attn_out_norm", *shape.attn_out_norm, {c.hidden_size});
  if (shape.mlp_out_norm) f32_tensor("mlp_out_norm", *shape.mlp_out_norm, {c.hidden_size});
  if (bool(shape.q_norm) != bool(shape.k_norm)) fail("q_norm, k_norm", "both or neither", "one of them");
  if (shape.q_norm) {
    f32_tensor("q_norm", *shape.q_norm, {c.head_dim});
    f32_tensor("k_norm", *shape.k_norm, {c.head_dim});
  }
  if (shape.cos_sin) f32_tensor("cos_sin", *shape.cos_sin, {-1, -1});  // its width: checked by the rotation
  const double eps = shape.eps.value_or(c.eps);
  const int64_t window = shape.sliding_window.value_or(c.sliding_window);
  if (window < 0) fail("sliding_window", ">= 0 (0 = unlimited)", window);
  layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), {std::move(qkv), std::move(qkv_part_panels)},
                          {{std::move(o_proj)}, {std::move(panels[1])}}, matrix_of(std::move(gate_up), std::move(panels[2])),
                          matrix_of(std::move(down), std::move(panels[3])), std::move(qkv_bias), one_term, eps,
                          shape.qk_eps.value_or(eps), shape.scale.value_or(c.scale), window, activation,
                          std::move(shape.attn_out_norm), std::move(shape.mlp_out_norm), std::move(shape.q_norm),
                          std::move(shape.k_norm), std::move(shape.cos_sin), std::move(mlp),
                          moe ? std::move(*moe) : nb::object(), experts});
}

void LayerStack::bind_kv_caches(const std::vector<std::tuple<Array, Array>>& kv_caches) {
  if (kv_caches.size() != layers_.size())
    fail("kv_caches", "one (key, value) pair per layer (" + str(int64_t(layers_.size())) + " layers)",
         int64_t(kv_caches.size()));
  kv_caches_ = kv_caches;  // the kernels check each cache against the step's tensors
}

LayerStack::PrefillOp LayerStack::prompt_attention_op(int64_t split) const {
  if (split < 0 || kv_caches_.empty()) return nullptr;  // no prompt rows marked
  const Array& key_cache = std::get<0>(kv_caches_.front());  // every layer's cache has one dtype and shape
  if (activations_ == "mixed-bf16" && attn::bf16_prompt_attention_reads(key_cache))
    return attn::prefill_attention_bf16;
  if (activations_ == "mixed" && attn::lanes_prompt_attention_reads(key_cache)) return attn::prefill_attention_lanes;
  return nullptr;
}

void LayerStack::reserve(int64_t tokens) {
  if (tokens <= capacity_) return;
  const auto& c = cfg_;
  const auto rows = size_t(tokens);
  qkv_.resize(rows * size_t((c.num_heads + 2 * c.num_kv_heads) * c.head_dim));
  q_.resize(rows * size_t(c.num_heads * c.head_dim));
  attn_.resize(q_.size());
  k_.resize(rows * size_t(c.num_kv_heads * c.head_dim));
  v_.resize(k_.size());
  gate_up_.resize(rows * size_t(2 * c.intermediate_size));
  act_.resize(rows * size_t(c.intermediate_size));
  capacity_ = tokens;
}

// out[rows, n] = x[rows, in] @ W^T through the packed kernel (which checks W against in and n).
// two_term_rows: quant_linear's (-1 = every row as `activations` says); the
// rows from there on are prompt_rows_.
void LayerStack::linear(const StackMatrix& w, float* x, int64_t rows, int64_t in, float* out, int64_t n,
                        int64_t two_term_rows) const {
  static const std::optional<Array> none;
  const auto run = [&](const PackedMatrix& part, const std::optional<Array>& panels, float* dst, int64_t cols) {
    const auto& [qtype, qs, d, m] = part;
    const bool cached = panels && linear::weight_panels_match_build(*panels);  // else an old build's: unused
    linear::quant_linear(f32(x, {size_t(rows), size_t(in)}), qtype, qs, d, m, f32(dst, {size_t(rows), size_t(cols)}),
                         linear_activations_, two_term_rows, cached ? panels : none, prompt_rows_);
  };
  if (w.parts.size() == 1) return run(w.parts[0], w.panels[0], out, n);
  int64_t col = 0;  // row parts: each part's outputs, then copied to its columns of out (checked at add_layer)
  for (size_t i = 0; i < w.parts.size(); ++i) {
    const auto cols = int64_t(std::get<1>(w.parts[i]).shape(0));
    part_out_.resize(size_t(rows * cols));
    run(w.parts[i], w.panels[i], part_out_.data(), cols);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + r * n + col, part_out_.data() + r * cols, size_t(cols) * sizeof(float));
    col += cols;
  }
}

// CpuBackend.forward (AttentionBackend.forward): cache the new K/V, then
// decodes through paged_attention and the rest through prefill_attention,
// except that sequences from prompt_seq_ on (the prompts of mixed-bf16 or
// mixed, where their prompt kernel reads the cache) go to prompt_op_.
void LayerStack::attention(size_t index, int64_t tokens, Array& slot_mapping, Array& seq_lens,
                           Array& block_tables, int64_t nd) {
  const auto& c = cfg_;
  const Layer& l = layers_[index];
  const auto t = size_t(tokens), h = size_t(c.num_heads), hkv = size_t(c.num_kv_heads), d = size_t(c.head_dim);
  const Array& key_cache = std::get<0>(kv_caches_[index]);
  const Array& value_cache = std::get<1>(kv_caches_[index]);
  attn::reshape_and_cache(f32(k_.data(), {t, hkv, d}), f32(v_.data(), {t, hkv, d}), key_cache, value_cache,
                          slot_mapping);
  const auto ns = int64_t(seq_lens.shape(0));
  if (nd == ns) {
    attn::paged_attention(f32(attn_.data(), {t, h, d}), f32(q_.data(), {t, h, d}), key_cache, value_cache,
                          block_tables, seq_lens, l.scale, l.sliding_window);
    return;
  }
  const auto* lens = static_cast<const int32_t*>(seq_lens.data());
  const auto* tables = static_cast<const int32_t*>(block_tables.data());
  const size_t width = block_tables.shape(1), decodes = size_t(nd);
  const nb::dlpack::dtype i32 = nb::dtype<int32_t>();
  if (nd) {
    attn::paged_attention(f32(attn_.data(), {decodes, h, d}), f32(q_.data(), {decodes, h, d}), key_cache,
                          value_cache, view(tables, {decodes, width}, i32), view(lens, {decodes}, i32), l.scale,
                          l.sliding_window);
  }
  // sequences [s0, s1) of the prefill part (prefill_starts_ counts from sequence nd)
  auto prefill = [&](int64_t s0, int64_t s1, PrefillOp op) {
    if (s0 >= s1) return;
    const int32_t row0 = prefill_starts_[size_t(s0 - nd)], rows = prefill_starts_[size_t(s1 - nd)] - row0;
    part_starts_.resize(size_t(s1 - s0 + 1));
    for (int64_t s = s0; s <= s1; ++s) part_starts_[size_t(s - s0)] = prefill_starts_[size_t(s - nd)] - row0;
    const size_t skip = (decodes + size_t(row0)) * h * d, n = size_t(s1 - s0);
    op(f32(attn_.data() + skip, {size_t(rows), h, d}), f32(q_.data() + skip, {size_t(rows), h, d}), key_cache,
       value_cache, view(part_starts_.data(), {n + 1}, i32), view(lens + s0, {n}, i32),
       view(tables + size_t(s0) * width, {n, width}, i32), l.scale, l.sliding_window);
  };
  prefill(nd, prompt_seq_, attn::prefill_attention);
  prefill(std::max(nd, prompt_seq_), ns, prompt_op_);
}

void LayerStack::run(Array hidden, Array out, Array positions, Array cos_sin, Array slot_mapping,
                     Array query_start_loc, Array seq_lens, Array block_tables, int64_t num_decodes,
                     int64_t first_prompt_row) {
  const auto& c = cfg_;
  // Everything that sizes or slices memory here is checked before the first
  // kernel runs; the kernels check the rest of their arguments themselves.
  if (kv_caches_.size() != layers_.size())
    fail("kv_caches", "one bound (key, value) pair per layer (" + str(int64_t(layers_.size())) + " layers)",
         str(int64_t(kv_caches_.size())) + " bound (call bind_kv_caches first)");
  const attn::TensorArg ht = f32_tensor("hidden", hidden, {-1, c.hidden_size});
  const int64_t tokens = ht.dim(0);
  f32_tensor("out", out, {tokens, c.hidden_size});
  if (ht.data == out.data() && tokens) fail("out", "a tensor other than hidden", "hidden itself");
  attn::int_tensor("positions", positions, 64, {tokens});
  attn::int_tensor("slot_mapping", slot_mapping, 64, {tokens});
  const attn::TensorArg lens = attn::int_tensor("seq_lens", seq_lens, 32, {-1});
  const int64_t ns = lens.dim(0);
  const attn::TensorArg qsl = attn::int_tensor("query_start_loc", query_start_loc, 32, {ns + 1});
  attn::int_tensor("block_tables", block_tables, 32, {ns, -1});
  if (num_decodes < 0 || num_decodes > ns || num_decodes > tokens)
    fail("num_decodes", "in [0, num_seqs = " + str(ns) + "] and <= T = " + str(tokens), num_decodes);
  const auto* starts = static_cast<const int32_t*>(qsl.data);
  if (starts[ns] != tokens)
    fail("query_start_loc[-1]", "T = " + str(tokens) + " (the step's tokens)", starts[ns]);
  if (first_prompt_row < -1 || first_prompt_row > tokens)
    fail("first_prompt_row", "-1 (no prompt rows marked) or in [0, T = " + str(tokens) + "]", first_prompt_row);
  // The marked prompt rows: "mixed" attends them on its own kernel, "mixed-bf16"
  // also computes them in bfloat16 in every matrix.
  const bool marks = (activations_ == "mixed" || activations_ == "mixed-bf16") && first_prompt_row >= 0;
  const int64_t split = marks ? first_prompt_row : -1;
  const int64_t bf16_split = activations_ == "mixed-bf16" ? split : -1;
  if (tokens == 0) return;
  if (num_decodes < ns) {  // meta.prefill_part's query_start_loc
    prefill_starts_.assign(starts + num_decodes, starts + ns + 1);
    for (int32_t& s : prefill_starts_) s -= int32_t(num_decodes);
  }
  // mixed-bf16 / mixed: the prompt sequences' attention on their own kernel
  // (from the first sequence starting at or after first_prompt_row; verify
  // rows before it keep the shared one)
  prompt_seq_ = ns;
  prompt_op_ = prompt_attention_op(split);
  if (prompt_op_) {
    prompt_seq_ = num_decodes;
    while (prompt_seq_ < ns && starts[prompt_seq_] < first_prompt_row) ++prompt_seq_;
  }
  reserve(tokens);
  first_prompt_row_ = first_prompt_row;

  auto* x = static_cast<float*>(out.data());  // each layer's normed rows and output
  for (size_t i = 0; i < layers_.size(); ++i)
    layer(i, hidden, x, tokens, positions, cos_sin, slot_mapping, seq_lens, block_tables, num_decodes, bf16_split);
  ops::fused_add_rms_norm(f32(x, {size_t(tokens), size_t(c.hidden_size)}), hidden, final_norm_, c.eps);
}

void LayerStack::python_mlp(const nb::callable& mlp, float* x, int64_t tokens) const {
  const int64_t hid = cfg_.hidden_size;
  const size_t shape[2] = {size_t(tokens), size_t(hid)};
  nb::object rows = nb::cast(nb::ndarray<nb::pytorch, float, nb::ndim<2>>(x, 2, shape, nb::handle()));
  const nb::object prompt = first_prompt_row_ < 0 ? nb::object(nb::none()) : nb::object(nb::int_(first_prompt_row_));
  nb::object result = mlp(rows, prompt);
  Array out;
  if (!nb::try_cast(result, out)) fail("mlp", "a float32 [T, hidden] tensor", "another object");
  const attn::TensorArg t = f32_tensor("mlp result", out, {tokens, hid});
  if (t.data != x) std::memcpy(x, t.data, size_t(tokens * hid) * sizeof(float));
}

// One layer (DecoderLayer.forward): hidden holds the residual, x [T, hidden]
// the previous layer's output and then this layer's.
void LayerStack::layer(size_t i, Array& hidden, float* x, int64_t tokens, Array& positions, Array& cos_sin,
                       Array& slot_mapping, Array& seq_lens, Array& block_tables, int64_t num_decodes,
                       int64_t bf16_split) {
  const auto& c = cfg_;
  const Layer& l = layers_[i];
  const auto t = size_t(tokens), hid = size_t(c.hidden_size);
  const int64_t qkv_w = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, q_w = c.num_heads * c.head_dim;
  const Array x_rows = f32(x, {t, hid});
  if (i == 0)
    ops::rms_norm(x_rows, hidden, l.input_norm, l.eps);  // the embedding rows are the first residual
  else
    ops::fused_add_rms_norm(x_rows, hidden, l.input_norm, l.eps);

  linear(l.qkv, x, tokens, c.hidden_size, qkv_.data(), qkv_w, bf16_split);
  if (l.qkv_bias) {  // torch's `out += bias`: one float32 add per element
    const auto* b = static_cast<const float*>(l.qkv_bias->data());
    for (size_t r = 0; r < t; ++r) {
      float* row = qkv_.data() + r * size_t(qkv_w);
      for (int64_t j = 0; j < qkv_w; ++j) row[j] += b[j];
    }
  }
  const Array qkv_rows = f32(qkv_.data(), {t, size_t(qkv_w)});
  if (l.q_norm) ops::qk_rms_norm(qkv_rows, *l.q_norm, *l.k_norm, c.num_heads, c.num_kv_heads, c.head_dim, l.qk_eps);
  ops::rotary_embedding(positions, qkv_rows, l.cos_sin ? *l.cos_sin : cos_sin, c.num_heads, c.num_kv_heads,
                        c.head_dim);
  const auto h = size_t(c.num_heads), hkv = size_t(c.num_kv_heads), d = size_t(c.head_dim);
  ops::split_qkv(qkv_rows, f32(q_.data(), {t, h, d}), f32(k_.data(), {t, hkv, d}), f32(v_.data(), {t, hkv, d}));
  attention(i, tokens, slot_mapping, seq_lens, block_tables, num_decodes);
  // a middle layer of "mixed": every row on one term here (two_term_rows 0)
  const int64_t rest_split = l.one_term ? 0 : bf16_split;
  linear(l.o_proj, attn_.data(), tokens, q_w, x, c.hidden_size, rest_split);
  if (l.attn_out_norm) ops::rms_norm(x_rows, x_rows, *l.attn_out_norm, l.eps);  // in place: a row at a time

  ops::fused_add_rms_norm(x_rows, hidden, l.post_norm, l.eps);
  if (l.mlp) {
    if (l.moe && l.moe->ready())
      l.moe->forward(x, tokens, x);
    else
      python_mlp(*l.mlp, x, tokens);
    if (l.mlp_out_norm) ops::rms_norm(x_rows, x_rows, *l.mlp_out_norm, l.eps);
    return;
  }
  linear(l.gate_up, x, tokens, c.hidden_size, gate_up_.data(), 2 * c.intermediate_size, rest_split);
  const Array act = f32(act_.data(), {t, size_t(c.intermediate_size)});
  const Array gate_up = f32(gate_up_.data(), {t, size_t(2 * c.intermediate_size)});
  switch (l.activation) {
    case Activation::SiLU:
      ops::silu_and_mul(act, gate_up);
      break;
    case Activation::GeluTanh:
      ops::gelu_tanh_and_mul(act, gate_up);
      break;
  }
  linear(l.down, act_.data(), tokens, c.intermediate_size, x, c.hidden_size, rest_split);
  if (l.mlp_out_norm) ops::rms_norm(x_rows, x_rows, *l.mlp_out_norm, l.eps);
}

}  // namespace paged::cpu::model
