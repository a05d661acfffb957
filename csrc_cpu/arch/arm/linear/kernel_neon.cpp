// Advanced SIMD (NEON) build of both float32-activation paths
// (quant_linear.h), aarch64 only: the 8 accumulator lanes as two float32x4
// (lanes 0-3, 4-7), so each output follows the scalar build's order of
// operations and matches it bit for bit (csrc_cpu/tests/kernel_linear_driver.cpp).
//  - int16 path (M <= kInt16MaxRows): per block, the codes widened to int16
//    once and multiplied with every row's hi and lo codes (vmull_s16); the
//    pairwise adds give lane l the products of elements 2l, 2l+1 (+16).
//  - fp32 path: each weight row's codes widened to fp32 once into the
//    thread's scratch, then tiles of kTileRows x rows sweep it.
#include <algorithm>
#include <cmath>

#include "arch/arm/linear/neon_codes.h"

namespace paged::cpu::linear::isa_neon {
namespace {

using neon::block_codes;
using neon::Codes8;

constexpr int64_t kTileRows = 4;  // x rows per fp32 tile: 8 accumulators, 8 codes, 2 x vectors

// out = hsum8(acc) + sm in the fixed order of quant_linear.h.
inline float finish(float32x4_t lo, float32x4_t hi, float sm) {
  float v[kLanes];
  vst1q_f32(v, lo);
  vst1q_f32(v + 4, hi);
  return hsum8(v) + sm;
}

// Lane sums (lanes 0-3 of elements 0-7 and 16-23, or 4-7 of 8-15 and 24-31)
// of w * x for two 8-element int16 groups: exact int32.
inline int32x4_t lane_dot(int16x8_t w0, int16x8_t x0, int16x8_t w1, int16x8_t x1) {
  const int32x4_t a = vpaddq_s32(vmull_s16(vget_low_s16(w0), vget_low_s16(x0)), vmull_high_s16(w0, x0));
  const int32x4_t b = vpaddq_s32(vmull_s16(vget_low_s16(w1), vget_low_s16(x1)), vmull_high_s16(w1, x1));
  return vaddq_s32(a, b);
}

}  // namespace

void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>&) {
  const int64_t nb = a.blocks();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    float32x4_t acc[kInt16MaxRows][2];
    float sm[kInt16MaxRows] = {};
    for (int64_t r = 0; r < a.M; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const Codes8 c = block_codes(a.qtype, row, b);
      const int16x8_t w[4] = {vmovl_s8(vget_low_s8(c.lo)), vmovl_high_s8(c.lo), vmovl_s8(vget_low_s8(c.hi)),
                              vmovl_high_s8(c.hi)};
      const float32x4_t db = vdupq_n_f32(d[b]);
      for (int64_t r = 0; r < a.M; ++r) {
        const int16_t* hi = a.xq + (r * nb + b) * kXBlock;
        const int16_t* lo = hi + kBlock;
        const float s = a.xscale[2 * (r * nb + b)], s_lo = a.xscale[2 * (r * nb + b) + 1];
        for (int half = 0; half < 2; ++half) {  // lanes 0-3: elements 0-7, 16-23; lanes 4-7: 8-15, 24-31
          const int e = 8 * half;
          const int32x4_t ih = lane_dot(w[half], vld1q_s16(hi + e), w[2 + half], vld1q_s16(hi + 16 + e));
          const int32x4_t il = lane_dot(w[half], vld1q_s16(lo + e), w[2 + half], vld1q_s16(lo + 16 + e));
          const float32x4_t scaled_hi = vmulq_n_f32(vcvtq_f32_s32(ih), s);
          const float32x4_t t = vfmaq_n_f32(scaled_hi, vcvtq_f32_s32(il), s_lo);
          acc[r][half] = vfmaq_f32(acc[r][half], db, t);
        }
        if (m) sm[r] = std::fma(m[b], a.xs[b * a.M + r], sm[r]);
      }
    }
    for (int64_t r = 0; r < a.M; ++r) a.out[r * a.N + n] = finish(acc[r][0], acc[r][1], sm[r]);
  }
}

void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  const int64_t nb = a.blocks();
  scratch.resize(size_t(a.K));
  float* codes = scratch.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b) {
      const Codes8 c = block_codes(a.qtype, row, b);
      float32x4_t v[8];
      neon::widen(c.lo, v);
      neon::widen(c.hi, v + 4);
      for (int j = 0; j < 8; ++j) vst1q_f32(codes + b * kBlock + 4 * j, v[j]);
    }
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    for (int64_t r0 = 0; r0 < a.M; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, a.M - r0);
      float32x4_t acc[kTileRows][2];
      float sm[kTileRows] = {};
      for (int64_t i = 0; i < kTileRows; ++i) acc[i][0] = acc[i][1] = vdupq_n_f32(0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const float* q = codes + b * kBlock;
        float32x4_t qv[8];
        for (int j = 0; j < 8; ++j) qv[j] = vld1q_f32(q + 4 * j);
        const float32x4_t db = vdupq_n_f32(d[b]);
        for (int64_t i = 0; i < rows; ++i) {
          const float* x = a.x + (r0 + i) * a.K + b * kBlock;
          for (int half = 0; half < 2; ++half) {  // t[l] = q[l]*x[l], then fma with +8, +16, +24
            const int e = 4 * half;
            float32x4_t t = vmulq_f32(qv[half], vld1q_f32(x + e));
            t = vfmaq_f32(t, qv[2 + half], vld1q_f32(x + 8 + e));
            t = vfmaq_f32(t, qv[4 + half], vld1q_f32(x + 16 + e));
            t = vfmaq_f32(t, qv[6 + half], vld1q_f32(x + 24 + e));
            acc[i][half] = vfmaq_f32(acc[i][half], db, t);
          }
          if (m) sm[i] = std::fma(m[b], a.xs[b * a.M + r0 + i], sm[i]);
        }
      }
      for (int64_t i = 0; i < rows; ++i) a.out[(r0 + i) * a.N + n] = finish(acc[i][0], acc[i][1], sm[i]);
    }
  }
}

}  // namespace paged::cpu::linear::isa_neon
