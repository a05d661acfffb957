// Portable build of the quantized linear: the reference order of operations
// (quant_linear.h) spelled out over 8 emulated lanes, with explicit fma so the
// result matches the SIMD builds bit for bit.
#include <cmath>

#include "linear/quant_linear.h"

namespace paged::cpu::linear::isa_scalar {

void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  const int64_t nb = a.blocks();
  scratch.resize(size_t(a.K));
  float* codes = scratch.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b)
      for (int k = 0; k < kBlock; ++k) codes[b * kBlock + k] = float(block_code(a.qtype, row, b, k));
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    for (int64_t r = 0; r < a.M; ++r) {
      const float* x = a.x + r * a.K;
      float acc[8] = {};
      float sm = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const float* q = codes + b * kBlock;
        const float* xb = x + b * kBlock;
        for (int l = 0; l < 8; ++l) {
          float t = q[l] * xb[l];
          for (int j = 8; j < kBlock; j += 8) t = std::fma(q[j + l], xb[j + l], t);
          acc[l] = std::fma(d[b], t, acc[l]);
        }
        if (m) sm = std::fma(m[b], a.xs[b * a.M + r], sm);
      }
      a.out[r * a.N + n] = hsum8(acc) + sm;
    }
  }
}

}  // namespace paged::cpu::linear::isa_scalar
