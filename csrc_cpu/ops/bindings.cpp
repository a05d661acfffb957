// paged._C_cpu fused elementwise ops of a decoder layer (ops/ops.h).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "module.h"
#include "ops/ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu {
void register_ops(nb::module_& m) {
  namespace o = ops;
  m.def("rms_norm", &o::rms_norm, "out"_a, "x"_a, "weight"_a, "eps"_a,
        "out[T, N] = x / sqrt(mean(x^2) + eps) * weight (out may be x).");
  m.def("fused_add_rms_norm", &o::fused_add_rms_norm, "x"_a, "residual"_a, "weight"_a, "eps"_a,
        "In place: residual += x, then x = rms_norm(residual) * weight.");
  m.def("silu_and_mul", &o::silu_and_mul, "out"_a, "gate_up"_a,
        "out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:].");
  m.def("gelu_tanh_and_mul", &o::gelu_tanh_and_mul, "out"_a, "gate_up"_a,
        "out[T, I] = gelu_tanh(gate_up[:, :I]) * gate_up[:, I:] (GELU's tanh approximation).");
  m.def("qk_rms_norm", &o::qk_rms_norm, "qkv"_a, "q_weight"_a, "k_weight"_a, "num_heads"_a, "num_kv_heads"_a,
        "head_dim"_a, "eps"_a,
        "In place: RMSNorm of every q head (weights q_weight [D]) and k head (k_weight [D]) of fused qkv "
        "rows [T, (H + 2 Hkv) * D]; v untouched.");
  m.def("rotary_embedding", &o::rotary_embedding, "positions"_a, "qkv"_a, "cos_sin_cache"_a, "num_heads"_a,
        "num_kv_heads"_a, "head_dim"_a,
        "Half (neox) RoPE in place on the q and k heads of fused qkv rows [T, (H + 2 Hkv) * D]; "
        "cos_sin_cache float32 [max_pos, R] holds cos then sin of pos * inv_freq; the first R (even, <= D) "
        "dims of each head rotate, the rest pass.");
  m.def("split_qkv", &o::split_qkv, "qkv"_a, "q"_a, "k"_a, "v"_a,
        "Copy fused qkv rows into contiguous q [T, H, D], k and v [T, Hkv, D].");
  m.def("argmax_rows", &o::argmax_rows, "logits"_a, "out"_a,
        "out[T] (int64) = the first index of each row's maximum of logits [T, V] (float32), as torch.argmax "
        "(a NaN counts as the maximum).");
  m.def("moe_route", &o::moe_route, "x"_a, "router"_a, "top_k"_a, "scoring"_a, "normalize"_a, "weights"_a, "ids"_a,
        "weights [T, top_k] (float32) and ids [T, top_k] (int64) = the mixture-of-experts routing of x [T, hidden] "
        "by router [experts, hidden] (float32): logits in a fixed order, 'softmax' or 'sigmoid' scores, the top_k "
        "best first (ties to the lower id), divided by their sum when normalize (core/models/moe.py route).");
  m.def("fused_ops_isa", &o::fused_ops_isa, "SIMD build the fused ops use now.");
  m.def("set_fused_ops_isa", &o::set_fused_ops_isa, "name"_a, "Choose 'auto', 'avx2' or 'scalar'.");
  m.def("supported_fused_ops_isas", &o::supported_fused_ops_isas, "Fused-op builds this CPU can run, best first.");
}
}  // namespace paged::cpu
