// The int8 path's definition in plain C++ (int8.h), the scalar build the SIMD
// builds match bit for bit: the quantization of x (one block at a time, the
// reference for the vector quantizers), and per output a signed int32 dot
// product per block, then the fp32 steps with explicit fma.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "linear/int8.h"

namespace paged::cpu::linear {
namespace isa_scalar {

// int8x2's low term of one row (int8.h), from the row's int8 quantization
// (hi codes, dx) as the build's x8_quantize made it: the definition, which
// every build but avx512 runs (this file is compiled without FMA contraction).
// Rewrites dx as the low scale s = dx / 256 and xs as s * sum of 256 hi + lo.
void x8_low_term(const float* x, int64_t K, QType t, const int8_t* hi, int8_t* lo, float* dx, int32_t* lo_corr,
                       float* xs) {
  const int32_t offset = unsigned_offset(t);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float d = dx[b], s = d * kI8LowScale;  // exact: a power of two (unless dx is subnormal)
    const float* xb = x + b * kBlock;
    const int8_t* hb = hi + b * kBlock;
    int8_t* lb = lo + b * kBlock;
    // Branch-free lanes (the selects vectorise under this file's
    // -fno-trapping-math, csrc_cpu/CMakeLists.txt); the test is per block.
    if (s > 0.f) {  // not for a zero block or a NaN dx (the row is NaN anyway)
      for (int k = 0; k < kBlock; ++k) {
        const float res = xb[k] - d * float(hb[k]);
        float q = res / s;
        q = q < -float(kI8Max) ? -float(kI8Max) : q;
        q = q > float(kI8Max) ? float(kI8Max) : q;
        q = (q + kI8RoundMagic) - kI8RoundMagic;  // round half to even
        lb[k] = int8_t(q);
      }
    } else {
      std::memset(lb, 0, kBlock);
    }
    int32_t sum_hi = 0, sum_lo = 0;
    for (int k = 0; k < kBlock; ++k) {
      sum_hi += hb[k];
      sum_lo += lb[k];
    }
    const int32_t sum = sum_hi * 256 + sum_lo;  // |sum| <= 32 * 32639 < 2^24: exact as a float
    dx[b] = s;
    lo_corr[b] = -offset * sum_lo;
    xs[b] = s * float(sum);
  }
}

void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs) {
  const int32_t offset = unsigned_offset(t);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* q = codes + b * kBlock;
    float amax = 0.f;
    for (int k = 0; k < kBlock; ++k) {
      const float v = std::fabs(xb[k]);
      amax = (v > amax || v != v) ? v : amax;  // a NaN sticks
    }
    float scale = amax / float(kI8Max);
    int32_t sum = 0;
    if (!(amax <= FLT_MAX)) {  // NaN or inf: the row's outputs become NaN
      scale = NAN;
      std::fill(q, q + kBlock, int8_t(0));
    } else if (scale == 0.f) {
      std::fill(q, q + kBlock, int8_t(0));
    } else {
      for (int k = 0; k < kBlock; ++k) {
        float v = xb[k] / scale;
        v = std::min(std::max(v, -float(kI8Max)), float(kI8Max));  // rounding commutes with integer bounds
        q[k] = int8_t((v + kI8RoundMagic) - kI8RoundMagic);
        sum += q[k];
      }
    }
    dx[b] = scale;
    corr[b] = -offset * sum;
    xs[b] = scale * float(sum);
  }
}

void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel&) {
  const int64_t nb = a.blocks(), K = a.K;
  std::vector<int8_t> w(static_cast<size_t>(K));  // one weight row's signed codes
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b)
      for (int k = 0; k < kBlock; ++k) w[size_t(b * kBlock + k)] = int8_t(block_code(a.qtype, row, b, k));
    const float* d = a.d + n * nb;
    const float* m = a.m ? a.m + n * nb : nullptr;
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* xq = a.x8 + r * K;
      const int8_t* lo = a.x8_lo ? a.x8_lo + r * K : nullptr;
      const float* dx = a.x8_scale + r * nb;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int k = 0; k < kBlock; ++k) isum += int32_t(w[size_t(b * kBlock + k)]) * int32_t(xq[b * kBlock + k]);
        if (lo) {  // int8x2: hi * 256 + lo, the block's sum of W times the 16-bit codes
          int32_t isum_lo = 0;
          for (int k = 0; k < kBlock; ++k) isum_lo += int32_t(w[size_t(b * kBlock + k)]) * int32_t(lo[b * kBlock + k]);
          isum = isum * 256 + isum_lo;
        }
        const float scale = d[b] * dx[b];  // rounded on its own, as the SIMD multiply
        acc = std::fma(scale, float(isum), acc);
        if (m) acc = std::fma(m[b], a.x8_sum[r * nb + b], acc);
      }
      a.out[r * a.N + n] = acc;
    }
  }
}

}  // namespace isa_scalar
}  // namespace paged::cpu::linear
