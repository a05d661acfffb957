// Portable build of the quantized linear: the reference order of operations
// (quant_linear.h) spelled out over 8 emulated lanes, exact int32 lane sums and
// explicit fma, so the result matches the SIMD builds bit for bit.
#include <cmath>

#include "linear/quant_linear.h"

namespace paged::cpu::linear::isa_scalar {

void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch) {
  const int64_t nb = a.blocks();
  scratch.resize(size_t(a.K));
  int16_t* codes = scratch.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b)
      for (int k = 0; k < kBlock; ++k) codes[b * kBlock + k] = int16_t(block_code(a.qtype, row, b, k));
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    for (int64_t r = 0; r < a.M; ++r) {
      const int16_t* x = a.xq + r * nb * kXBlock;
      const float* s = a.xscale + r * nb * 2;
      float acc[kLanes] = {};
      float sm = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int16_t* hi = x + b * kXBlock;
        const int16_t* lo = hi + kBlock;
        int32_t dot_hi[kLanes] = {}, dot_lo[kLanes] = {};
        for (int k = 0; k < kBlock; ++k) {
          const int32_t code = codes[b * kBlock + k];
          dot_hi[lane_of(k)] += code * int32_t(hi[k]);
          dot_lo[lane_of(k)] += code * int32_t(lo[k]);
        }
        for (int l = 0; l < kLanes; ++l) {
          const float scaled_hi = s[2 * b] * float(dot_hi[l]);  // rounded on its own, as the SIMD multiply
          const float t = std::fma(float(dot_lo[l]), s[2 * b + 1], scaled_hi);
          acc[l] = std::fma(d[b], t, acc[l]);
        }
        if (m) sm = std::fma(m[b], a.xs[b * a.M + r], sm);
      }
      a.out[r * a.N + n] = hsum8(acc) + sm;
    }
  }
}

}  // namespace paged::cpu::linear::isa_scalar
