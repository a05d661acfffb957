// Boundary checks, the weight's tile layout and the split over threads of the
// bfloat16 prompt rows (bf16_prompt.h); the build of kernel_builds.h
// (bf16_prompt_rows: AMX) does the arithmetic.
#include "linear/bf16_prompt.h"
#include "linear/ops.h"

#include <stdexcept>
#include <string>

#include "attention/tensor_args.h"
#include "kernel_builds.h"
#include "linear/aligned.h"
#include "runtime/parallel.h"

namespace nb = nanobind;

namespace paged::cpu::linear {
namespace {

using attn::fail;

const nb::dlpack::dtype kBf16{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};

const Bf16Kernels& require_supported() {
  const Bf16Kernels* k = bf16_prompt_rows();
  if (!k)
    throw std::runtime_error(
        "bf16_linear: this CPU (or OS) offers no AMX-BF16 tiles; bf16_prompt_supported() says where it runs");
  return *k;
}

}  // namespace

bool bf16_prompt_supported() { return bf16_prompt_rows() != nullptr; }

void build_bf16_weight(const Array& w16, const Array& out) {
  const attn::TensorArg tw = tensor_of("w16", w16, kBf16, 2);
  const int64_t N = tw.dim(0), K = tw.dim(1);
  if (N < 1 || K < kBf16Step || K % kBf16Step)
    fail("w16", "shape [N, K] with N >= 1 and K a positive multiple of 32", "shape " + tw.shape_str());
  const attn::TensorArg to = tensor_of("out", out, kBf16, 1);
  const int64_t want = bf16_weight_elems(N, K);
  if (to.dim(0) != want)
    fail("out", std::to_string(want) + " elements (bf16_weight_elems: N rounded up to 32, times K)",
         std::to_string(to.dim(0)));
  const auto* w = static_cast<const uint16_t*>(tw.data);
  auto* dst = static_cast<uint16_t*>(to.data);
  const int64_t steps = K / kBf16Step, tiles = want / K / 16;
  nb::gil_scoped_release no_gil;
  for (int64_t c16 = 0; c16 < tiles; ++c16)
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t kk = 0; kk < 16; ++kk)
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t row = 16 * c16 + n, k = s * kBf16Step + 2 * kk + j;
            *dst++ = row < N ? w[row * K + k] : uint16_t(0);
          }
}

// The tile-layout copy of an [N, K] weight (build_bf16_weight's), checked: its data.
static const uint16_t* check_bf16_weight(const char* name, const Array& weight, int64_t N, int64_t K) {
  const attn::TensorArg tw = tensor_of(name, weight, kBf16, 1);
  const int64_t want = bf16_weight_elems(N, K);
  if (tw.dim(0) != want)
    fail(name, std::to_string(want) + " elements (build_bf16_weight's layout of an [N, K] = [" +
                       std::to_string(N) + ", " + std::to_string(K) + "] weight)",
         std::to_string(tw.dim(0)));
  return static_cast<const uint16_t*>(tw.data);
}

void bf16_linear(const Array& x, const Array& weight, const Array& out) {
  const attn::TensorArg tx = tensor_of("x", x, nb::dtype<float>(), 2);
  const attn::TensorArg to = tensor_of("out", out, nb::dtype<float>(), 2);
  Bf16Args a;
  a.M = tx.dim(0);
  a.K = tx.dim(1);
  a.N = to.dim(1);
  if (a.M < 1 || a.K < kBf16Step || a.K % kBf16Step)
    fail("x", "shape [M, K] with M >= 1 and K a positive multiple of 32", "shape " + tx.shape_str());
  if (to.dim(0) != a.M || a.N < 1)
    fail("out", "shape [" + std::to_string(a.M) + ", N] with N >= 1 (x's rows)", "shape " + to.shape_str());
  const uint16_t* w = check_bf16_weight("weight", weight, a.N, a.K);
  const Bf16Kernels& k = require_supported();
  a.w = w;
  a.out = static_cast<float*>(to.data);
  const auto* xf = static_cast<const float*>(tx.data);
  nb::gil_scoped_release no_gil;
  const bool parallel = a.M * a.N * a.K >= kSerialMacs;
  a.x = pack_bf16_rows(k, xf, a.M, a.K, parallel);
  parallel_for(a.groups() * a.chunks(), parallel, Schedule::Static, 1, [&](int64_t i) { k.item(a, i); });
}

const uint16_t* pack_bf16_rows(const Bf16Kernels& k, const float* x, int64_t M, int64_t K, bool parallel) {
  static thread_local AlignedVector<uint16_t> packed;  // the caller's; its team writes and reads it
  const int64_t groups = (M + kBf16Rows - 1) / kBf16Rows;
  if (packed.size() < size_t(groups * kBf16Rows * K)) packed.resize(size_t(groups * kBf16Rows * K));
  uint16_t* const xp = packed.data();  // by pointer: in the team's threads `packed` names their own
  parallel_for(groups, parallel, Schedule::Static, 1, [&](int64_t g) { k.pack_group(x, M, K, g, xp); });
  return xp;
}

}  // namespace paged::cpu::linear
