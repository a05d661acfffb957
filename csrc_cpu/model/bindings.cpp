// paged._C_cpu.LayerStack: all decoder layers of a CPU step in one call (model/layer_stack.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "model/layer_stack.h"
#include "module.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu {
void register_model(nb::module_& m) {
  using model::LayerStack;
  nb::class_<LayerStack>(m, "LayerStack",
                         "The decoder layers of a float32 model on packed GGUF weights, each as its description "
                         "says (core/models/spec.py), run in one call per step with the kernels and arguments of the Python path (bitwise "
                         "identical). Single-threaded: one engine thread per stack. activations: the packed "
                         "linear's 'float32', 'int8' or 'int8x2' (quant_linear's argument) for every matrix, or 'mixed' "
                         "(int8 for every row of the O, gate/up and down projections of layers added with one_term, "
                         "int8x2 elsewhere; run()'s prompt rows attend on their own kernel) or "
                         "'mixed-bf16' (int8x2 for rows before first_prompt_row, bfloat16 on AMX tiles for the prompt rows).")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t, model::Array, std::string>(),
           "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "hidden_size"_a, "intermediate_size"_a, "eps"_a,
           "scale"_a, "sliding_window"_a, "final_norm"_a, "activations"_a = "float32")
      .def(
          "add_layer",
          [](LayerStack& self, model::Array input_norm, model::Array post_norm, std::vector<model::PackedMatrix> qkv,
             std::optional<model::Array> qkv_bias, model::PackedMatrix o_proj,
             std::optional<model::PackedMatrix> gate_up, std::optional<model::PackedMatrix> down,
             std::vector<std::optional<model::Array>> panels, bool one_term,
             std::optional<double> eps, std::optional<double> qk_eps, std::optional<double> scale,
             std::optional<int64_t> sliding_window, std::string activation, std::optional<model::Array> attn_out_norm,
             std::optional<model::Array> mlp_out_norm, std::optional<model::Array> q_norm,
             std::optional<model::Array> k_norm, std::optional<model::Array> cos_sin,
             std::vector<std::optional<model::Array>> qkv_part_panels, std::optional<nb::callable> mlp,
             std::optional<nb::object> moe) {
            self.add_layer(std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(qkv_bias),
                           std::move(o_proj), std::move(gate_up), std::move(down), std::move(panels), one_term,
                           model::LayerShape{eps, qk_eps, scale, sliding_window, std::move(activation),
                                             std::move(attn_out_norm), std::move(mlp_out_norm), std::move(q_norm),
                                             std::move(k_norm), std::move(cos_sin)},
                           std::move(qkv_part_panels), std::move(mlp), std::move(moe));
          },
          "input_norm"_a, "post_norm"_a, "qkv"_a, "qkv_bias"_a.none(), "o_proj"_a, "gate_up"_a.none(), "down"_a.none(),
          "panels"_a = std::vector<std::optional<model::Array>>{}, "one_term"_a = false, nb::kw_only(),
          "eps"_a.none() = nb::none(), "qk_eps"_a.none() = nb::none(), "scale"_a.none() = nb::none(),
          "sliding_window"_a.none() = nb::none(), "activation"_a = "silu", "attn_out_norm"_a.none() = nb::none(),
          "mlp_out_norm"_a.none() = nb::none(), "q_norm"_a.none() = nb::none(), "k_norm"_a.none() = nb::none(),
          "cos_sin"_a.none() = nb::none(), "qkv_part_panels"_a = std::vector<std::optional<model::Array>>{},
          "mlp"_a.none() = nb::none(), "moe"_a.none() = nb::none(),
          "Append a layer; each matrix is (qtype, qs, d, m or None) as quant_linear takes it. panels: [] or "
          "four (qkv, o_proj, gate_up, down), each None or the matrix's build_weight_panels tensor (used while "
          "it matches the active linear ISA); a qkv of several row parts takes its parts' panels as "
          "qkv_part_panels ([] or one None / tensor per part; its panels entry None). mlp: in place of "
          "gate_up and down (None), a callable mlp(x, first_prompt_row) -> float32 [T, hidden] for the layer's "
          "MLP (a mixture of experts), called with x [T, hidden] over the stack's scratch; moe (with mlp): the "
          "layer's MoeExperts with its router set, run in mlp's place while it is ready (same bits). one_term ('mixed' only): every row takes one int8 term in "
          "this layer's O, gate/up and down projections. The layer's description (None: the stack's): eps of "
          "its norms, qk_eps of the per-head q_norm / k_norm [head_dim] (Qwen3, Gemma 3), attention scale and "
          "sliding_window, activation of the gate ('silu' or 'gelu_tanh'), attn_out_norm / mlp_out_norm "
          "[hidden] (RMSNorm of o_proj's / down's output before the residual add: Gemma 3) and cos_sin, the "
          "layer's float32 rotary table [max_pos, R] (R < head_dim: partial rotary; None: run()'s).")
      .def("bind_kv_caches", &LayerStack::bind_kv_caches, "kv_caches"_a,
           "One (key_cache, value_cache) per layer, used by the following run() calls.")
      .def("run", &LayerStack::run, "hidden"_a, "out"_a, "positions"_a, "cos_sin"_a, "slot_mapping"_a,
           "query_start_loc"_a, "seq_lens"_a, "block_tables"_a, "num_decodes"_a, "first_prompt_row"_a = -1,
           "All layers and the final add + RMSNorm: hidden [T, hidden] (embedding rows; becomes the "
           "residual) -> out [T, hidden]. first_prompt_row: rows from there on are prompt rows (-1: none marked).")
      .def_prop_ro("num_layers", &LayerStack::num_layers)
      .def_prop_ro("num_bound_caches", &LayerStack::num_bound_caches)
      .def_prop_ro("activations", &LayerStack::activations);
}
}  // namespace paged::cpu
