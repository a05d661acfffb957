#include "model/moe_experts.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>

#include "attention/tensor_args.h"
#include "linear/ops.h"
#include "linear/weight_panels.h"
#include "module.h"
#include "ops/ops.h"
#include "runtime/parallel.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu::model {
namespace {

using attn::fail;
using attn::positive;

// An unowned float32 ndarray over scratch the caller keeps alive for the call.
Array f32(const float* data, std::initializer_list<size_t> shape) {
  return Array(const_cast<float*>(data), shape.size(), shape.begin(), nb::handle(), nullptr, nb::dtype<float>(),
               nb::device::cpu::value);
}

// A float32 tensor of `shape` (entries < 0 free).
attn::TensorArg f32_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape) {
  attn::DType dt;
  attn::TensorArg t = attn::float_tensor(name, a, shape, &dt);
  if (dt != attn::DType::F32) fail(name, "dtype float32", std::string("dtype ") + attn::dtype_name(dt));
  return t;
}

// The matrix checked as quant_linear checks it, [N, K] its shape.
linear::LinearArgs require_matrix(const char* name, const PackedMatrix& w, int64_t n, int64_t k) {
  linear::LinearArgs a;
  linear::check_weight(a, std::get<0>(w), std::get<1>(w), std::get<2>(w), std::get<3>(w));
  if (a.N != n || a.K != k)
    fail(name, "[" + std::to_string(n) + ", " + std::to_string(k) + "]",
         "[" + std::to_string(a.N) + ", " + std::to_string(a.K) + "]");
  return a;
}

}  // namespace

MoeExperts::MoeExperts(int64_t hidden_size, int64_t intermediate_size, std::string activations, bool one_term)
    : hidden_(positive("hidden_size", hidden_size)), inter_(positive("intermediate_size", intermediate_size)) {
  // two_term_rows_: -1 every row on two int8 terms (int8x2), 0 none (int8, or "mixed" with one_term)
  if (activations == "mixed") {
    two_term_rows_ = one_term ? 0 : -1;
  } else if (activations == "int8" || activations == "int8x2") {
    if (one_term) fail("one_term", "False unless activations are 'mixed'", "True");
    two_term_rows_ = activations == "int8" ? 0 : -1;
  } else {
    fail("activations", "'int8', 'int8x2' or 'mixed'", "'" + activations + "'");
  }
}

void MoeExperts::add_expert(PackedMatrix gate_up, PackedMatrix down, std::optional<Array> gate_up_panels,
                            std::optional<Array> down_panels) {
  linear::LinearArgs g = require_matrix("gate_up", gate_up, 2 * inter_, hidden_);
  linear::LinearArgs d = require_matrix("down", down, hidden_, inter_);
  take_panels(g, std::move(gate_up_panels));
  take_panels(d, std::move(down_panels));
  gate_up_args_.push_back(g);
  down_args_.push_back(d);
  gate_up_.push_back(std::move(gate_up));
  down_.push_back(std::move(down));
}

void MoeExperts::take_panels(linear::LinearArgs& a, std::optional<Array> panels) {
  if (!panels) return;
  linear::use_panels(a, *panels);  // checks them against the matrix and the build
  panels_.push_back(std::move(*panels));
  panels_layout_ = linear::weight_panel_layout();
}

// The layout, not each panel's header: run() asks once per layer and step
// (reading 2 x experts headers cost 4% of a 1B MoE decode).
bool MoeExperts::panels_match_build() const {
  return panels_.empty() || linear::weight_panel_layout() == panels_layout_;
}

void MoeExperts::run_groups(const std::vector<linear::LinearArgs>& w, const std::vector<int64_t>& experts,
                            const std::vector<int64_t>& starts, const float* in, float* out) {
  const int64_t G = int64_t(experts.size());
  auto group = [&](int64_t g) {
    linear::LinearArgs a = w[size_t(experts[size_t(g)])];
    const int64_t r0 = starts[size_t(g)];
    a.M = starts[size_t(g) + 1] - r0;
    a.x = in + r0 * a.K;
    a.out = out + r0 * a.N;
    linear::int8_linear_checked(a, two_rows(a.M));
  };
  // Dynamic: the experts' row counts differ. Fewer experts than threads keep
  // each call's own split of its weight rows.
  if (spread_experts && G >= omp_get_max_threads() && !omp_in_parallel())
    parallel_for(G, true, Schedule::Dynamic, 1, group);
  else
    for (int64_t g = 0; g < G; ++g) group(g);
}

int64_t MoeExperts::run(const Array& x, const Array& ids, const Array& weights, const Array& out) {
  if (!panels_match_build())  // another build's kernels cannot read them (and the arrays may be stand-ins)
    fail("experts", "weight panels of the active linear build '" + std::string(linear::current_isa()) + "'",
         "panels of another build (make the experts again under this build)");
  const int64_t H = hidden_, E = num_experts();
  const attn::TensorArg tx = f32_tensor("x", x, {-1, H});
  const int64_t T = tx.dim(0);
  const attn::TensorArg ti = attn::int_tensor("ids", ids, 64, {T, -1});
  const int64_t k = ti.dim(1);
  if (k < 1) fail("ids", "at least one choice per row", "shape " + ti.shape_str());
  const attn::TensorArg tw = f32_tensor("weights", weights, {T, k});
  const attn::TensorArg to = f32_tensor("out", out, {T, H});
  const auto* id = static_cast<const int64_t*>(ti.data);
  for (int64_t s = 0; s < T * k; ++s)
    if (id[s] < 0 || id[s] >= E)
      fail("ids", "expert ids in [0, " + std::to_string(E) + ")", std::to_string(id[s]) + " at slot " + std::to_string(s));
  return compute(static_cast<const float*>(tx.data), T, id, static_cast<const float*>(tw.data), k,
                 static_cast<float*>(to.data));
}

void MoeExperts::set_router(Array router, int64_t top_k, const std::string& scoring, bool normalize) {
  f32_tensor("router", router, {num_experts(), hidden_});
  sigmoid_ = ops::check_routing(num_experts(), top_k, scoring);
  router_ = std::move(router);
  top_k_ = top_k;
  normalize_ = normalize;
}

void MoeExperts::set_shared(PackedMatrix gate_up, PackedMatrix down, std::optional<Array> gate_up_panels,
                            std::optional<Array> down_panels, std::optional<Array> gate) {
  linear::LinearArgs probe;
  linear::check_weight(probe, std::get<0>(gate_up), std::get<1>(gate_up), std::get<2>(gate_up), std::get<3>(gate_up));
  if (probe.N % 2) fail("shared gate_up", "an even number of rows (gate rows then up rows)", probe.N);
  const int64_t inter = probe.N / 2;
  linear::LinearArgs g = require_matrix("shared gate_up", gate_up, 2 * inter, hidden_);
  linear::LinearArgs d = require_matrix("shared down", down, hidden_, inter);
  if (gate) f32_tensor("shared_gate", *gate, {1, hidden_});
  take_panels(g, std::move(gate_up_panels));
  take_panels(d, std::move(down_panels));
  shared_gate_up_ = g;
  shared_down_ = d;
  shared_inter_ = inter;
  shared_arrays_ = {std::move(gate_up), std::move(down)};
  shared_gate_ = std::move(gate);
}

void MoeExperts::shared_rows(const float* x, int64_t T, float* y) {
  const int64_t H = hidden_, I = shared_inter_;
  shared_gate_up_out_.resize(size_t(T * 2 * I));
  shared_act_.resize(size_t(T * I));
  linear::LinearArgs g = *shared_gate_up_, d = *shared_down_;
  g.M = d.M = T;
  g.x = x;
  g.out = shared_gate_up_out_.data();
  d.x = shared_act_.data();
  d.out = y;
  {
    nb::gil_scoped_release no_gil;
    linear::int8_linear_checked(g, two_rows(T));
  }
  ops::silu_and_mul(f32(shared_act_.data(), {size_t(T), size_t(I)}),
                    f32(shared_gate_up_out_.data(), {size_t(T), size_t(2 * I)}));
  {
    nb::gil_scoped_release no_gil;
    linear::int8_linear_checked(d, two_rows(T));
  }
  if (!shared_gate_) return;
  // the gate's sigmoid as moe_route computes it (one expert, sigmoid scoring):
  // the Python layer's gate comes from the same pass
  gate_w_.resize(size_t(T));
  gate_id_.resize(size_t(T));
  ops::route_rows(ops::RouteArgs{x, static_cast<const float*>(shared_gate_->data()), gate_w_.data(), gate_id_.data(),
                                 H, 1, 1, true, false},
                  T);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t h = 0; h < H; ++h) y[r * H + h] = gate_w_[size_t(r)] * y[r * H + h];
}

void MoeExperts::forward(const float* x, int64_t tokens, float* out) {
  if (!ready()) fail("experts", "a router set and panels of the active linear build", "neither or one");
  route_weights_.resize(size_t(tokens * top_k_));
  route_ids_.resize(size_t(tokens * top_k_));
  ops::route_rows(ops::RouteArgs{x, static_cast<const float*>(router_->data()), route_weights_.data(),
                                 route_ids_.data(), hidden_, num_experts(), top_k_, sigmoid_, normalize_},
                  tokens);
  if (shared_gate_up_) {  // before compute(), which may write over x (out may be x)
    shared_out_.resize(size_t(tokens * hidden_));
    shared_rows(x, tokens, shared_out_.data());
  }
  stack_runs += compute(x, tokens, route_ids_.data(), route_weights_.data(), top_k_, out);
  if (shared_gate_up_)  // MoeMlp.__call__'s out + shared, one rounding per element
    for (int64_t i = 0; i < tokens * hidden_; ++i) out[i] = out[i] + shared_out_[size_t(i)];
}

int64_t MoeExperts::compute(const float* xp, int64_t T, const int64_t* id, const float* wp, int64_t k, float* op) {
  const int64_t H = hidden_, I = inter_, E = num_experts();
  const int64_t S = T * k;

  // Group the slots by expert, experts in order of first choice, each
  // expert's slots in slot order (moe.py _group_slots).
  first_.assign(size_t(E), -1);
  std::vector<int64_t> experts, counts;
  for (int64_t s = 0; s < S; ++s) {
    int64_t& g = first_[size_t(id[s])];
    if (g < 0) {
      g = int64_t(experts.size());
      experts.push_back(id[s]);
      counts.push_back(0);
    }
    ++counts[size_t(g)];
  }
  const int64_t G = int64_t(experts.size());
  std::vector<int64_t> starts(size_t(G) + 1, 0), fill(size_t(G), 0);
  for (int64_t g = 0; g < G; ++g) starts[size_t(g) + 1] = starts[size_t(g)] + counts[size_t(g)];
  order_.resize(size_t(S));
  position_.resize(size_t(S));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t g = first_[size_t(id[s])];
    const int64_t i = starts[size_t(g)] + fill[size_t(g)]++;
    order_[size_t(i)] = s;
    position_[size_t(s)] = i;
  }
  xs_.resize(size_t(S * H));
  gate_up_out_.resize(size_t(S * 2 * I));
  act_.resize(size_t(S * I));
  ys_.resize(size_t(S * H));
  for (int64_t i = 0; i < S; ++i)
    std::memcpy(xs_.data() + i * H, xp + (order_[size_t(i)] / k) * H, size_t(H) * sizeof(float));
  {
    nb::gil_scoped_release no_gil;
    run_groups(gate_up_args_, experts, starts, xs_.data(), gate_up_out_.data());
  }
  ops::silu_and_mul(f32(act_.data(), {size_t(S), size_t(I)}), f32(gate_up_out_.data(), {size_t(S), size_t(2 * I)}));
  {
    nb::gil_scoped_release no_gil;
    run_groups(down_args_, experts, starts, act_.data(), ys_.data());
  }
  // Each row's choices in order, each product rounded on its own (built
  // without FP contraction): torch's ys * weights, then the adds.
  for (int64_t r = 0; r < T; ++r) {
    float* o = op + r * H;
    const float* y0 = ys_.data() + position_[size_t(r * k)] * H;
    const float w0 = wp[r * k];
    for (int64_t h = 0; h < H; ++h) o[h] = y0[h] * w0;
    for (int64_t j = 1; j < k; ++j) {
      const float* y = ys_.data() + position_[size_t(r * k + j)] * H;
      const float w = wp[r * k + j];
      for (int64_t h = 0; h < H; ++h) o[h] = o[h] + y[h] * w;
    }
  }
  return G;
}

}  // namespace paged::cpu::model

namespace paged::cpu {
void register_moe_experts(nb::module_& m) {
  using model::MoeExperts;
  nb::class_<MoeExperts>(m, "MoeExperts",
                         "One mixture-of-experts layer's experts on packed GGUF weights: run() takes a step's "
                         "routed rows and computes every chosen expert's SiLU-gated MLP and each row's weighted sum "
                         "in one call, bitwise as core/models/moe.py's Python path (float32, one device).")
      .def(nb::init<int64_t, int64_t, std::string, bool>(), "hidden_size"_a, "intermediate_size"_a,
           "activations"_a, "one_term"_a = false)
      .def("add_expert", &MoeExperts::add_expert, "gate_up"_a, "down"_a, "gate_up_panels"_a.none() = nb::none(),
           "down_panels"_a.none() = nb::none(),
           "Append an expert: gate_up [2 * intermediate, hidden] and down [hidden, intermediate], each "
           "(qtype, qs, d, m or None) as quant_linear takes it, and each matrix's build_weight_panels tensor "
           "or None (panels of the active linear build; its kernels then read only them).")
      .def_prop_ro("panels_match_build", &MoeExperts::panels_match_build,
                   "Whether every expert's panels carry the active linear build's layout (run() refuses otherwise).")
      .def("run", &MoeExperts::run, "x"_a, "ids"_a, "weights"_a, "out"_a,
           "out [T, hidden] = each row's top-k experts (ids int64 [T, k], weights float32 [T, k]) on x [T, hidden], "
           "summed in choice order; returns the number of distinct experts run.")
      .def("set_router", &MoeExperts::set_router, "router"_a, "top_k"_a, "scoring"_a, "normalize"_a,
           "The layer's router (float32 [experts, hidden]) and routing (moe_route's arguments), for the C++ "
           "layer stack, which then runs routing and experts itself (LayerStack.add_layer's moe).")
      .def("set_shared", &MoeExperts::set_shared, "gate_up"_a, "down"_a, "gate_up_panels"_a.none(),
           "down_panels"_a.none(), "gate"_a.none(),
           "The layer's shared expert for the C++ layer stack: gate_up [2 * shared_intermediate, hidden] and down "
           "[hidden, shared_intermediate] as add_expert takes them, and its sigmoid gate (float32 [1, hidden]) or "
           "None; the stack then adds gate * its output to every row's routed sum.")
      .def_prop_ro("ready", &MoeExperts::ready, "A router set and panels of the active linear build.")
      .def_ro("stack_runs", &MoeExperts::stack_runs,
              "Distinct experts run by the layer stack's calls (run()'s are its return values).")
      .def_prop_ro("num_experts", &MoeExperts::num_experts)
      .def_rw("spread_experts", &MoeExperts::spread_experts,
              "True (default): with at least as many chosen experts as threads, one parallel region per matrix "
              "kind spreads the experts over the threads; False: each expert's call splits its own weight rows. "
              "Same bits either way.");
}
}  // namespace paged::cpu
