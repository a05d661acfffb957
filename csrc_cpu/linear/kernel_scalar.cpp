// Portable builds of both quantized-linear paths: the reference orders of
// operations (quant_linear.h) spelled out over 8 emulated lanes, exact int32
// lane sums (int16 path) and explicit fma, so each matches its SIMD twin bit
// for bit.
#include <cmath>

#include "linear/quant_linear.h"

namespace paged::cpu::linear::isa_scalar {
namespace {

// The loops both paths share: widen a weight row's codes once, then per x row
// accumulate block_lanes(codes of block b, r, b, acc) and Q4_1's offset sum.
template <class BlockLanes>
void rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch, BlockLanes block_lanes) {
  const int64_t nb = a.blocks();
  scratch.resize(size_t(a.K));
  float* codes = scratch.data();  // small integers: exact as floats
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b)
      for (int k = 0; k < kBlock; ++k) codes[b * kBlock + k] = float(block_code(a.qtype, row, b, k));
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    for (int64_t r = 0; r < a.M; ++r) {
      float acc[kLanes] = {};
      float sm = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float t[kLanes];
        block_lanes(codes + b * kBlock, r, b, t);
        for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(d[b], t[l], acc[l]);
        if (m) sm = std::fma(m[b], a.xs[b * a.M + r], sm);
      }
      a.out[r * a.N + n] = hsum8(acc) + sm;
    }
  }
}

}  // namespace

void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  const int64_t nb = a.blocks();
  rows(a, n0, n1, scratch, [&](const float* q, int64_t r, int64_t b, float t[kLanes]) {
    const int16_t* hi = a.xq + (r * nb + b) * kXBlock;
    const int16_t* lo = hi + kBlock;
    const float s = a.xscale[2 * (r * nb + b)], s_lo = a.xscale[2 * (r * nb + b) + 1];
    int32_t dot_hi[kLanes] = {}, dot_lo[kLanes] = {};
    for (int k = 0; k < kBlock; ++k) {
      const int32_t code = int32_t(q[k]);
      dot_hi[lane_of(k)] += code * int32_t(hi[k]);
      dot_lo[lane_of(k)] += code * int32_t(lo[k]);
    }
    for (int l = 0; l < kLanes; ++l) {
      const float scaled_hi = s * float(dot_hi[l]);  // rounded on its own, as the SIMD multiply
      t[l] = std::fma(float(dot_lo[l]), s_lo, scaled_hi);
    }
  });
}

void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  rows(a, n0, n1, scratch, [&](const float* q, int64_t r, int64_t b, float t[kLanes]) {
    const float* x = a.x + r * a.K + b * kBlock;
    for (int l = 0; l < kLanes; ++l) {
      t[l] = q[l] * x[l];
      for (int j = 8; j < kBlock; j += 8) t[l] = std::fma(q[j + l], x[j + l], t[l]);
    }
  });
}

}  // namespace paged::cpu::linear::isa_scalar
