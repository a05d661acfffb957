// Linear layers on GGUF-packed weights (Q4_0 / Q4_1 / Q8_0) with int16
// activations (contract: docs/kernels.md, "Quantized linear (CPU)").
//
// Once per call, each row r of x is quantized per 32-element block b:
//   s[r, b] = max|x[r, b's elements]| / 32767          (fp32 division; 0 for a zero block)
//   a[r, k] = clamp(round_half_even(x[r, k] / s), +-32767)   (fp32 division)
// Every output out[r, n] is then evaluated in one fixed order that does not
// depend on M, on how rows are tiled, on the thread count or on the ISA: per
// block b and lane l < 8
//   I[l]   = sum of Q[k] * a[k] over k in {2l, 2l+1, 16+2l, 17+2l}   (int32, exact)
//   acc[l] = fma(d_b, s[r, b] * float(I[l]), acc[l])
//   sm     = fma(m_b, xs[r, b], sm)                  (Q4_1 only)
// then out = hsum8(acc) + sm, where Q are the integer codes (q - 8 for Q4_0),
// xs[r, b] = hsum8 of the lane sums of x over block b and hsum8 is
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). |I[l]| <= 4 * 128 * 32767 < 2^24, so
// float(I[l]) is exact. The lanes are those of AVX2's vpmaddwd on the codes of
// elements 0-15 and 16-31; the scalar build emulates them, so all builds agree
// bitwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace paged::cpu::linear {

constexpr int64_t kBlock = 32;  // weights per quant block along K
constexpr int kLanes = 8;       // fp32 accumulator lanes per output
constexpr int32_t kActMax = 32767;  // int16 activations lie in [-kActMax, kActMax]

enum class QType { Q4_0, Q4_1, Q8_0 };

struct LinearArgs {
  QType qtype;
  int64_t M = 0, N = 0, K = 0;
  const int16_t* xq = nullptr;  // [M, K] x quantized per block
  const float* xscale = nullptr;  // [M, K/32] the scales s of xq's blocks
  const uint8_t* qs = nullptr;  // [N, K/2] nibbles or [N, K] int8
  const float* d = nullptr;     // [N, K/32]
  const float* m = nullptr;     // [N, K/32] for Q4_1, else null
  const float* xs = nullptr;    // [K/32, M] block sums of x, xs[b * M + r] (block-major:
                                // a block's sums of consecutive rows are adjacent)
  float* out = nullptr;         // [M, N]
  int64_t blocks() const { return K / kBlock; }
  int64_t row_bytes() const { return qtype == QType::Q8_0 ? K : K / 2; }
};

// Computes out[:, n0:n1]. `scratch` is the calling thread's buffer (grown as
// needed) for int16 codes widened once and reused by many rows of x.
using RowsKernel = void (*)(const LinearArgs&, int64_t n0, int64_t n1, std::vector<int16_t>& scratch);

namespace isa_scalar {
void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch);
}
namespace isa_avx2 {
void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<int16_t>& scratch);
}

// Rows of x up to this many read the packed codes directly; more rows first
// widen a panel of weight rows' codes to int16 once (same arithmetic either way).
constexpr int64_t kDirectMaxRows = 4;

// Horizontal sum of 8 lanes in the fixed order above.
inline float hsum8(const float v[kLanes]) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// The lane (vpmaddwd on elements 0-15 and 16-31) that sums element k of a block.
constexpr int lane_of(int k) { return (k & 15) >> 1; }

// Integer code k of block b of a weight row, as stored by GGUF.
inline int block_code(QType t, const uint8_t* row, int64_t b, int k) {
  if (t == QType::Q8_0) return int(static_cast<int8_t>(row[b * kBlock + k]));
  const uint8_t byte = row[b * (kBlock / 2) + (k & 15)];
  const int q = k < 16 ? (byte & 0x0F) : (byte >> 4);
  return t == QType::Q4_0 ? q - 8 : q;
}

RowsKernel active_kernel();
const char* current_isa();
void set_isa(const std::string& name);
std::vector<std::string> supported_isas();

}  // namespace paged::cpu::linear
