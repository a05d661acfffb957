// One mixture-of-experts layer's chosen experts in one extension call
// (core/models/moe.py MoeMlp, steps 2-4, on one device): the step's (row,
// k-th choice) slots grouped by expert in order of first choice, each
// expert's gate/up on its rows (linear::quant_linear), one SiLU-and-mul pass
// over every expert's rows (ops::silu_and_mul), each expert's down on its
// rows, and each row's k weighted outputs summed in its choice order. The
// same kernel entry points, arguments and order as the Python path, so the
// results are bitwise identical; what it saves is the per-expert Python
// dispatch, DLPack capsules and torch allocations (~2 x top-k calls per
// layer at batch 1) and, with at least as many experts as threads, a
// parallel region per expert matrix: the experts are spread over the threads,
// each expert's call serial on its thread (the kernels' bits do not depend
// on the thread count).
//
// For the C++ layer stack, forward() runs the whole MLP: step 1 too (the
// router set by set_router, through ops::route_rows as the Python layer's
// ops.moe_route does) and a shared expert with its gate (set_shared).
//
// Not thread-safe (scratch is shared state): one engine thread per layer.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "linear/quant_linear.h"

namespace paged::cpu::model {

using Array = nanobind::ndarray<>;
// (qtype, qs, d, m) of one packed GGUF matrix, as linear::quant_linear takes it.
using PackedMatrix = std::tuple<std::string, Array, Array, std::optional<Array>>;

class MoeExperts {
 public:
  // activations: the experts' packed linear setting, "int8", "int8x2" or
  // "mixed" (int8x2 with one_term: every row on one int8 term, as
  // CpuPackedLinear's "mixed" for the layers of one_term_layers).
  MoeExperts(int64_t hidden_size, int64_t intermediate_size, std::string activations, bool one_term);
  // Appends expert num_experts(): gate_up [2 * intermediate, hidden] (gate
  // rows then up rows), down [hidden, intermediate]; each with its
  // persistent weight panels or none (checked against the matrix and the
  // active linear build, whose kernels then read only them).
  void add_expert(PackedMatrix gate_up, PackedMatrix down, std::optional<Array> gate_up_panels = std::nullopt,
                  std::optional<Array> down_panels = std::nullopt);
  // Whether every expert's panels carry the active linear build's layout
  // (true without panels): run() refuses otherwise.
  bool panels_match_build() const;
  // out [T, hidden] = sum over j of weights[r, j] * expert ids[r, j] (x[r]),
  // float32 throughout; returns the number of distinct experts run.
  int64_t run(const Array& x, const Array& ids, const Array& weights, const Array& out);
  // The layer's router (float32 [experts, hidden]) and routing (ops::moe_route's
  // arguments), for forward(): the C++ layer stack's whole MLP.
  void set_router(Array router, int64_t top_k, const std::string& scoring, bool normalize);
  // The layer's shared expert, which every row runs beside its routed ones
  // (Qwen2-MoE): gate_up [2 * shared_intermediate, hidden], down [hidden,
  // shared_intermediate], their panels or none, and its sigmoid gate
  // (float32 [1, hidden]) or none; forward() then adds gate * its output to
  // the routed sum, as MoeMlp._shared and its caller do.
  void set_shared(PackedMatrix gate_up, PackedMatrix down, std::optional<Array> gate_up_panels,
                  std::optional<Array> down_panels, std::optional<Array> gate);
  // Whether forward() can run: a router set and panels_match_build().
  bool ready() const { return router_.has_value() && panels_match_build(); }
  // out [T, hidden] = run() on ops::route_rows' routing of x [T, hidden]
  // (x and out the caller's, checked by it, out may be x; the GIL held): bitwise the
  // Python layer's moe_route then run(). Counts its experts in stack_runs.
  void forward(const float* x, int64_t tokens, float* out);
  int64_t stack_runs = 0;  // distinct experts run by forward() since construction
  int64_t num_experts() const { return int64_t(gate_up_.size()); }
  int64_t hidden_size() const { return hidden_; }
  // false: every expert matrix's call splits its own weight rows over the
  // threads (a parallel region each, the schedule before): same bits, kept
  // for tests and paired benchmarks.
  bool spread_experts = true;

 private:
  int64_t hidden_, inter_;
  int64_t two_term_rows_;  // rows on two int8 terms: -1 (every row) or 0 (one term)
  std::vector<PackedMatrix> gate_up_, down_;  // keep the arrays alive
  std::vector<Array> panels_;                 // and the panels,
  std::string panels_layout_;                 // made for this layout (weight_panel_layout)
  std::vector<linear::LinearArgs> gate_up_args_, down_args_;  // their checked weights
  // Each group's rows [starts[g], starts[g + 1]) of `in` through its
  // expert's matrix into `out` (one parallel region over the groups when
  // there are enough of them, else each call's own).
  void run_groups(const std::vector<linear::LinearArgs>& w, const std::vector<int64_t>& experts,
                  const std::vector<int64_t>& starts, const float* in, float* out);
  // a's kernels read panels (checked), which are kept alive and their layout noted
  void take_panels(linear::LinearArgs& a, std::optional<Array> panels);
  // run() after its checks: x [T, hidden], ids and weights [T, k], out [T, hidden]
  int64_t compute(const float* x, int64_t T, const int64_t* ids, const float* weights, int64_t k, float* out);
  // y [T, hidden] = the shared expert on x, times its gate where it has one
  void shared_rows(const float* x, int64_t T, float* y);
  // rows of a T-row call on two int8 terms (quant_linear's two_term_rows)
  int64_t two_rows(int64_t T) const { return two_term_rows_ < 0 ? T : std::min(two_term_rows_, T); }
  std::optional<linear::LinearArgs> shared_gate_up_, shared_down_;
  std::vector<PackedMatrix> shared_arrays_;  // keeps the shared expert's arrays alive
  std::optional<Array> shared_gate_;
  int64_t shared_inter_ = 0;
  std::vector<float> shared_gate_up_out_, shared_act_, shared_out_, gate_w_;
  std::vector<int64_t> gate_id_;
  std::optional<Array> router_;  // set_router's
  int64_t top_k_ = 0;
  bool sigmoid_ = false, normalize_ = false;
  std::vector<float> route_weights_;
  std::vector<int64_t> route_ids_;
  std::vector<float> xs_, gate_up_out_, act_, ys_;  // scratch, [slots, width] in grouped order
  std::vector<int64_t> first_, order_, position_;
};

}  // namespace paged::cpu::model
