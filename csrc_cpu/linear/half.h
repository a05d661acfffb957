// The 16-bit float weight layouts of the linear ("f16", "bf16"): a GGUF F16
// or BF16 matrix held as its own 16-bit values, W [N, K] float16 or
// bfloat16, multiplied by float32 activations. Every 16-bit value is exact in
// float32, so the products are those of float32 math on the dequantized
// weight; only the summation order is the kernel's, and it is fixed:
//
//   per output (r, n), from acc[l] = +0 for the eight lanes l:
//     for k = 0, 1, ..., K - 1 in order:  acc[k % 8] = fma(w[n, k], x[r, k], acc[k % 8])
//   out[r, n] = hsum8(acc)                                  (quant_linear.h's order)
//
// with w[n, k] the weight widened to float32 (exact). An output depends only
// on its row of x and its weight row, so a row's bits are the same alone or
// in a call of any M, any tiling, any thread count and every build (the
// scalar build is the definition; the AVX2 build, which the x86 builds share,
// runs a k-chunk of 8 as one vector fma, lane l = k % 8, and pads a tail of
// K % 8 with zeros in both operands: fma(0, 0, acc) = acc, since acc is
// never -0 (it starts at +0, and round-to-nearest never sums to -0 from
// there)). Error against the float64 product: each output is eight fma chains
// of ceil(K/8) terms plus three adds, so within (ceil(K/8) + 3) * 2^-24 of
// |x| @ |W|^T. NaN or inf in a row of x makes that row's outputs non-finite
// and leaves the other rows alone.
#pragma once

#include <cstdint>

#include "linear/quant_linear.h"

namespace paged::cpu::linear {

// One call's operands (checked at the boundary, half.cpp).
struct HalfArgs {
  bool bf16 = false;           // w is bfloat16 (else float16)
  int64_t M = 0, N = 0, K = 0;
  const float* x = nullptr;    // [M, K]
  const uint16_t* w = nullptr; // [N, K] the 16-bit values' bits
  float* out = nullptr;        // [M, N]
};

namespace isa_scalar {
void half_rows(const HalfArgs& h, int64_t n0, int64_t n1);  // the definition
}
namespace isa_avx2 {
void half_rows(const HalfArgs& h, int64_t n0, int64_t n1);  // arch/x86/linear/kernel_half_avx2.cpp
}

// The half kernel of the active linear build (its table entry, kernel_builds.cpp;
// the scalar definition where the build has none).
HalfKernel half_kernel();
// out[:, :] for the whole call, weight rows split over the threads.
void half_linear(const HalfArgs& h);

}  // namespace paged::cpu::linear
