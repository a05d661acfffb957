// Boundary of the fused ops: argument checks (once per call, ValueError /
// IndexError naming the value), the ISA choice and the split of rows over
// OpenMP threads.
#include "runtime/omp_compat.h"

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "attention/tensor_args.h"
#include "kernel_builds.h"
#include "ops/ops.h"

namespace paged::cpu::ops {
namespace {

using attn::fail;
using attn::positive;
using attn::TensorArg;

IsaSelector<const RowKernels*>& selector() { return fused_ops_selector(); }

const RowKernels* active() { return selector().active().kernel; }

// Below this many elements an OpenMP region costs more than it saves; such
// calls (batch-1 decode) run on the calling thread. Not much higher: a
// 16-row decode step's norms, RoPE and SiLU must still split over the team.
constexpr int64_t kSerialElements = int64_t(1) << 13;

// Runs fn(begin, end) over contiguous row ranges, one per thread. Each row is
// computed the same way whichever thread gets it (batch invariance).
template <class Fn>
void for_rows(int64_t rows, int64_t elements_per_row, const Fn& fn) {
  if (rows < 2 || rows * elements_per_row < kSerialElements || omp_in_parallel()) {
    fn(int64_t(0), rows);
    return;
  }
#pragma omp parallel
  {
    const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t begin = rows * id / n, end = rows * (id + 1) / n;
    if (begin < end) fn(begin, end);
  }
}

// float32 / bfloat16, C-contiguous, of the given rank pattern.
TensorArg elem_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape, Elem* elem) {
  attn::DType dt;
  TensorArg t = attn::float_tensor(name, a, shape, &dt);
  if (dt == attn::DType::F16) fail(name, "dtype float32 or bfloat16 (the fused ops' dtypes)", "dtype float16");
  *elem = dt == attn::DType::F32 ? Elem::F32 : Elem::BF16;
  return t;
}

void require_same_elem(const TensorArg& a, Elem ea, const TensorArg& b, Elem eb) {
  if (ea != eb)
    fail(b.name, "the dtype of " + a.name + " (" + (ea == Elem::F32 ? "float32" : "bfloat16") + ")",
         std::string("dtype ") + (eb == Elem::F32 ? "float32" : "bfloat16"));
}

float check_eps(double eps) {
  if (!(eps >= 0.0) || eps > 1.0) fail("eps", "in [0, 1]", eps);
  return float(eps);
}

// weight [width] of the rows' dtype.
TensorArg norm_weight(const Array& weight, const TensorArg& rows, Elem elem) {
  Elem we;
  TensorArg w = elem_tensor("weight", weight, {-1}, &we);
  require_same_elem(rows, elem, w, we);
  if (w.dim(0) != rows.dim(1))
    fail("weight", "shape [" + std::to_string(rows.dim(1)) + "] (one per element of a " + rows.name + " row)",
         "shape " + w.shape_str());
  return w;
}

}  // namespace

void rms_norm(Array out, Array x, Array weight, double eps) {
  Elem e, eo;
  TensorArg xt = elem_tensor("x", x, {-1, -1}, &e);
  TensorArg ot = elem_tensor("out", out, {-1, -1}, &eo);
  require_same_elem(xt, e, ot, eo);
  attn::require_same_shape(xt, ot);
  TensorArg wt = norm_weight(weight, xt, e);
  const NormArgs a{ot.data, xt.data, nullptr, wt.data, e, xt.dim(1), check_eps(eps)};
  const RowKernels* k = active();
  for_rows(xt.dim(0), a.width, [&](int64_t b, int64_t en) { k->rms_norm(a, b, en); });
}

void fused_add_rms_norm(Array x, Array residual, Array weight, double eps) {
  Elem e, er;
  TensorArg xt = elem_tensor("x", x, {-1, -1}, &e);
  TensorArg rt = elem_tensor("residual", residual, {-1, -1}, &er);
  require_same_elem(xt, e, rt, er);
  attn::require_same_shape(xt, rt);
  if (xt.data == rt.data && xt.numel()) fail("residual", "a tensor other than x", "x itself (both are updated)");
  TensorArg wt = norm_weight(weight, xt, e);
  const NormArgs a{xt.data, nullptr, rt.data, wt.data, e, xt.dim(1), check_eps(eps)};
  const RowKernels* k = active();
  for_rows(xt.dim(0), a.width, [&](int64_t b, int64_t en) { k->add_rms_norm(a, b, en); });
}

namespace {

// out [T, I] and gate_up [T, 2 I] of one dtype, checked once.
SiluMulArgs gated_args(Array& out, Array& gate_up) {
  Elem e, eo;
  TensorArg gt = elem_tensor("gate_up", gate_up, {-1, -1}, &e);
  TensorArg ot = elem_tensor("out", out, {-1, -1}, &eo);
  require_same_elem(gt, e, ot, eo);
  if (gt.dim(1) % 2) fail("gate_up", "an even last dim (gate then up)", "shape " + gt.shape_str());
  if (ot.dim(0) != gt.dim(0) || ot.dim(1) * 2 != gt.dim(1))
    fail("out", "shape [" + std::to_string(gt.dim(0)) + ", " + std::to_string(gt.dim(1) / 2) + "] (for gate_up " +
                    gt.shape_str() + ")",
         "shape " + ot.shape_str());
  return SiluMulArgs{ot.data, gt.data, e, ot.dim(1)};
}

}  // namespace

void silu_and_mul(Array out, Array gate_up) {
  const SiluMulArgs a = gated_args(out, gate_up);
  const RowKernels* k = active();
  for_rows(int64_t(gate_up.shape(0)), 2 * a.inter, [&](int64_t b, int64_t en) { k->silu_and_mul(a, b, en); });
}

void gelu_tanh_and_mul(Array out, Array gate_up) {
  const SiluMulArgs a = gated_args(out, gate_up);
  const RowKernels* k = active();
  for_rows(int64_t(gate_up.shape(0)), 2 * a.inter, [&](int64_t b, int64_t en) { k->gelu_tanh_and_mul(a, b, en); });
}

void qk_rms_norm(Array qkv, Array q_weight, Array k_weight, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, double eps) {
  positive("num_heads", num_heads);
  positive("num_kv_heads", num_kv_heads);
  positive("head_dim", head_dim);
  Elem e;
  TensorArg qt = elem_tensor("qkv", qkv, {-1, -1}, &e);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  attn::require_dim(qt, 1, width, "(num_heads + 2 * num_kv_heads) * head_dim");
  Elem eq, ek;
  const TensorArg qw = elem_tensor("q_weight", q_weight, {head_dim}, &eq);
  const TensorArg kw = elem_tensor("k_weight", k_weight, {head_dim}, &ek);
  require_same_elem(qt, e, qw, eq);
  require_same_elem(qt, e, kw, ek);
  const float ep = check_eps(eps);
  const size_t es = qt.elem_size, row_bytes = size_t(width) * es, k_offset = size_t(num_heads * head_dim) * es;
  auto* rows = static_cast<char*>(qt.data);
  const RowKernels* k = active();
  for_rows(qt.dim(0), (num_heads + num_kv_heads) * head_dim, [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) {  // the row's Q heads, then its K heads, each normed in place
      char* q = rows + size_t(r) * row_bytes;
      k->rms_norm(NormArgs{q, q, nullptr, qw.data, e, head_dim, ep}, 0, num_heads);
      k->rms_norm(NormArgs{q + k_offset, q + k_offset, nullptr, kw.data, e, head_dim, ep}, 0, num_kv_heads);
    }
  });
}

void rotary_embedding(Array positions, Array qkv, Array cos_sin_cache, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim) {
  positive("num_heads", num_heads);
  positive("num_kv_heads", num_kv_heads);
  if (positive("head_dim", head_dim) % 2) fail("head_dim", "an even number", head_dim);
  Elem e;
  TensorArg qt = elem_tensor("qkv", qkv, {-1, -1}, &e);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  attn::require_dim(qt, 1, width, "(num_heads + 2 * num_kv_heads) * head_dim");
  TensorArg pt = attn::int_tensor("positions", positions, 64, {qt.dim(0)});
  attn::DType cdt;
  TensorArg ct = attn::float_tensor("cos_sin_cache", cos_sin_cache, {-1, -1}, &cdt);
  if (cdt != attn::DType::F32)
    fail("cos_sin_cache", "dtype float32", std::string("dtype ") + attn::dtype_name(cdt));
  const int64_t rotary_dim = ct.dim(1);  // a partial-rotary table rotates each head's leading dims only
  if (rotary_dim % 2 || rotary_dim < 2 || rotary_dim > head_dim)
    fail("cos_sin_cache", "shape [max_pos, R], R even in [2, head_dim = " + std::to_string(head_dim) + "]",
         "shape " + ct.shape_str());
  const auto* pos = static_cast<const int64_t*>(pt.data);
  for (int64_t i = 0; i < pt.dim(0); ++i)
    if (pos[i] < 0 || pos[i] >= ct.dim(0))
      attn::fail_index("positions[" + std::to_string(i) + "]",
                       "a position in [0, " + std::to_string(ct.dim(0)) + ") (the rotary table's size)", pos[i]);
  const RopeArgs a{qt.data, pos, static_cast<const float*>(ct.data), e, num_heads + num_kv_heads, width, head_dim,
                   rotary_dim};
  const RowKernels* k = active();
  for_rows(qt.dim(0), (num_heads + num_kv_heads) * head_dim, [&](int64_t b, int64_t en) { k->rotary(a, b, en); });
}

void split_qkv(Array qkv, Array q, Array k, Array v) {
  attn::DType e, eq, ek, ev;
  TensorArg src = attn::float_tensor("qkv", qkv, {-1, -1}, &e);
  TensorArg qt = attn::float_tensor("q", q, {src.dim(0), -1, -1}, &eq);
  TensorArg kt = attn::float_tensor("k", k, {src.dim(0), -1, qt.dim(2)}, &ek);
  TensorArg vt = attn::float_tensor("v", v, {src.dim(0), -1, qt.dim(2)}, &ev);
  if (eq != e || ek != e || ev != e)
    fail(eq != e ? "q" : ek != e ? "k" : "v", std::string("the dtype of qkv (") + attn::dtype_name(e) + ")",
         std::string("dtype ") + attn::dtype_name(eq != e ? eq : ek != e ? ek : ev));
  attn::require_same_shape(kt, vt);
  const int64_t qw = qt.dim(1) * qt.dim(2), kw = kt.dim(1) * kt.dim(2);
  attn::require_dim(src, 1, qw + 2 * kw, "q, k and v widths together");
  const size_t es = src.elem_size;
  const auto* s = static_cast<const char*>(src.data);
  auto* qd = static_cast<char*>(qt.data);
  auto* kd = static_cast<char*>(kt.data);
  auto* vd = static_cast<char*>(vt.data);
  for_rows(src.dim(0), src.dim(1), [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) {
      const char* row = s + size_t(r * src.dim(1)) * es;
      std::memcpy(qd + size_t(r * qw) * es, row, size_t(qw) * es);
      std::memcpy(kd + size_t(r * kw) * es, row + size_t(qw) * es, size_t(kw) * es);
      std::memcpy(vd + size_t(r * kw) * es, row + size_t(qw + kw) * es, size_t(kw) * es);
    }
  });
}

void argmax_rows(Array logits, Array out) {
  attn::DType dt;
  TensorArg lt = attn::float_tensor("logits", logits, {-1, -1}, &dt);
  if (dt != attn::DType::F32) fail("logits", "dtype float32", std::string("dtype ") + attn::dtype_name(dt));
  TensorArg ot = attn::int_tensor("out", out, 64, {lt.dim(0)});
  if (lt.dim(1) < 1 || lt.dim(1) > std::numeric_limits<int32_t>::max())
    fail("logits", "rows of 1 to 2^31 - 1 values", "shape " + lt.shape_str());
  const ArgmaxArgs a{static_cast<const float*>(lt.data), static_cast<int64_t*>(ot.data), lt.dim(1)};
  const RowKernels* k = active();
  for_rows(lt.dim(0), lt.dim(1), [&](int64_t b, int64_t en) { k->argmax(a, b, en); });
}

bool check_routing(int64_t experts, int64_t top_k, const std::string& scoring) {
  if (top_k < 1 || top_k > experts) fail("top_k", "in [1, experts = " + std::to_string(experts) + "]", top_k);
  if (scoring != "softmax" && scoring != "sigmoid") fail("scoring", "'softmax' or 'sigmoid'", "'" + scoring + "'");
  return scoring == "sigmoid";
}

void route_rows(const RouteArgs& a, int64_t rows) {
  const RowKernels* k = active();
  for_rows(rows, a.experts * a.hidden, [&](int64_t b, int64_t en) { k->moe_route(a, b, en); });
}

void moe_route(Array x, Array router, int64_t top_k, const std::string& scoring, bool normalize, Array weights,
               Array ids) {
  const auto f32 = [](const char* name, const Array& a, std::initializer_list<int64_t> shape) {
    attn::DType dt;
    TensorArg t = attn::float_tensor(name, a, shape, &dt);
    if (dt != attn::DType::F32) fail(name, "dtype float32", std::string("dtype ") + attn::dtype_name(dt));
    return t;
  };
  const TensorArg xt = f32("x", x, {-1, -1});
  const TensorArg rt = f32("router", router, {-1, xt.dim(1)});
  const int64_t T = xt.dim(0), E = rt.dim(0);
  if (E < 1) fail("router", "at least one expert", "shape " + rt.shape_str());
  const bool sigmoid = check_routing(E, top_k, scoring);
  const TensorArg wt = f32("weights", weights, {T, top_k});
  const TensorArg it = attn::int_tensor("ids", ids, 64, {T, top_k});
  route_rows(RouteArgs{static_cast<const float*>(xt.data), static_cast<const float*>(rt.data),
                       static_cast<float*>(wt.data), static_cast<int64_t*>(it.data), xt.dim(1), E, top_k,
                       sigmoid, normalize},
             T);
}

std::string fused_ops_isa() { return selector().active().name; }

void set_fused_ops_isa(const std::string& name) { selector().set(name); }

std::vector<std::string> supported_fused_ops_isas() { return selector().supported(); }

}  // namespace paged::cpu::ops
