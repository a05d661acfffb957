// Fused elementwise ops of a decoder layer on CPU (RMSNorm, residual add,
// SiLU- and GELU-tanh-and-mul, per-head Q/K RMSNorm, RoPE, Q/K/V split), the
// greedy sampler's argmax and the mixture-of-experts routing: one pass over
// each row instead of a chain of small torch ops. Arguments are checked
// once in fused_ops.cpp; the row kernels (kernels.inc, built per ISA) trust them.
#pragma once

#include <string>
#include <vector>

#include <nanobind/ndarray.h>

#include "ops/row_kernels.h"

namespace paged::cpu::ops {

using Array = nanobind::ndarray<>;

// Python-facing entry points (bindings.cpp).
void rms_norm(Array out, Array x, Array weight, double eps);
void fused_add_rms_norm(Array x, Array residual, Array weight, double eps);
void silu_and_mul(Array out, Array gate_up);
void gelu_tanh_and_mul(Array out, Array gate_up);
void qk_rms_norm(Array qkv, Array q_weight, Array k_weight, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, double eps);
void rotary_embedding(Array positions, Array qkv, Array cos_sin_cache, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim);
void split_qkv(Array qkv, Array q, Array k, Array v);
void argmax_rows(Array logits, Array out);
// weights [T, top_k] (float32), ids [T, top_k] (int64) = the routing of x
// [T, hidden] by router [experts, hidden] (float32): RouteArgs' kernel, scoring
// "softmax" or "sigmoid".
void moe_route(Array x, Array router, int64_t top_k, const std::string& scoring, bool normalize, Array weights,
               Array ids);
// The same on arguments already checked (model/moe_experts.cpp), rows split over the threads.
void route_rows(const RouteArgs& a, int64_t rows);
// ValueError unless top_k is in [1, experts] and scoring "softmax" or "sigmoid"; true for sigmoid.
bool check_routing(int64_t experts, int64_t top_k, const std::string& scoring);
std::string fused_ops_isa();
void set_fused_ops_isa(const std::string& name);
std::vector<std::string> supported_fused_ops_isas();

}  // namespace paged::cpu::ops
