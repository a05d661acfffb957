// The f16 / bf16 weight layouts (half.h): the Python boundary, the split of
// the weight rows over the threads and the plain C++ kernel, the definition
// every build matches bit for bit. Built without FMA contraction (the
// baseline ISA): std::fma is the only fused step.
#include "linear/half.h"

#include <algorithm>
#include <cmath>

#include "attention/kernel_common.h"
#include "kernel_builds.h"
#include "linear/ops.h"
#include "runtime/parallel.h"

namespace nb = nanobind;

namespace paged::cpu::linear {
namespace {

constexpr int64_t kHalfChunkRows = 24;  // weight rows per work item (whole AVX2 register tiles)

}  // namespace

namespace isa_scalar {
void half_rows(const HalfArgs& h, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < h.M; ++r) {
    const float* x = h.x + r * h.K;
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* w = h.w + n * h.K;
      float acc[kLanes] = {};
      for (int64_t k = 0; k < h.K; ++k) {
        const float wk = h.bf16 ? attn::bf16_to_float(w[k]) : attn::f16_to_float(w[k]);
        acc[k % kLanes] = std::fma(wk, x[k], acc[k % kLanes]);
      }
      h.out[r * h.N + n] = hsum8(acc);
    }
  }
}
}  // namespace isa_scalar

HalfKernel half_kernel() {
  const HalfKernel k = active_kernels().half_rows;
  return k ? k : isa_scalar::half_rows;
}

void half_linear(const HalfArgs& h) {
  const HalfKernel kernel = half_kernel();
  const int64_t chunks = (h.N + kHalfChunkRows - 1) / kHalfChunkRows;
  const bool parallel = h.M * h.N * h.K >= kSerialMacs && chunks > 1;
  // dynamic: a thread that starts late (a busy neighbour on its core) takes
  // fewer chunks; an output's bits do not depend on which thread makes it
  parallel_for(chunks, parallel, Schedule::Dynamic, 1, [&](int64_t c) {
    kernel(h, c * kHalfChunkRows, std::min(h.N, (c + 1) * kHalfChunkRows));
  });
}

// The Python boundary (ops.h): w float16 or bfloat16 [N, K], x float32 [M, K], out float32 [M, N].
void half_linear(const Array& x, const Array& w, const Array& out) {
  attn::DType wt;
  const attn::TensorArg tw = attn::float_tensor("w", w, {-1, -1}, &wt);
  if (wt == attn::DType::F32) attn::fail("w", "dtype float16 or bfloat16", "dtype float32");
  HalfArgs h;
  h.bf16 = wt == attn::DType::BF16;
  h.N = tw.dim(0);
  h.K = tw.dim(1);
  if (h.N < 1 || h.K < 1) attn::fail("w", "at least one row and one column", "shape " + tw.shape_str());
  const attn::TensorArg tx = tensor_of("x", x, nb::dtype<float>(), 2);
  h.M = tx.dim(0);
  if (h.M < 1 || tx.dim(1) != h.K)
    attn::fail("x", "shape [M >= 1, " + std::to_string(h.K) + "] (K the weight's input size)", "shape " + tx.shape_str());
  const attn::TensorArg to = tensor_of("out", out, nb::dtype<float>(), 2);
  if (to.dim(0) != h.M || to.dim(1) != h.N)
    attn::fail("out", "shape [" + std::to_string(h.M) + ", " + std::to_string(h.N) + "] ([M, N])",
               "shape " + to.shape_str());
  h.x = static_cast<const float*>(tx.data);
  h.w = static_cast<const uint16_t*>(tw.data);
  h.out = static_cast<float*>(to.data);
  nb::gil_scoped_release no_gil;
  half_linear(h);
}

}  // namespace paged::cpu::linear
