// Linear layers on GGUF-packed weights (Q4_0 / Q4_1 / Q8_0), computed in fp32
// straight from the packed blocks (contract: docs/kernels.md, "Quantized
// linear (CPU)").
//
// Every output out[r, n] is evaluated in one fixed order that does not depend
// on M, on how rows are tiled, on the thread count or on the ISA: per block b
//   t[l]   = Q[l]*x[l]; t[l] = fma(Q[8+l], x[8+l], t[l]); ... (+16, +24)   l < 8
//   acc[l] = fma(d_b, t[l], acc[l])
//   sm     = fma(m_b, xs[r, b], sm)                  (Q4_1 only)
// then out = hsum8(acc) + sm, where Q are the integer codes as floats (q - 8
// for Q4_0), xs[r, b] = hsum8 of the lane sums of x over block b and hsum8 is
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). The scalar build emulates the 8
// lanes, so all builds agree bitwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace paged::cpu::linear {

constexpr int64_t kBlock = 32;  // weights per quant block along K

enum class QType { Q4_0, Q4_1, Q8_0 };

struct LinearArgs {
  QType qtype;
  int64_t M = 0, N = 0, K = 0;
  const float* x = nullptr;     // [M, K]
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
// needed) for fp32 codes widened once and reused by many rows of x.
using RowsKernel = void (*)(const LinearArgs&, int64_t n0, int64_t n1, std::vector<float>& scratch);

namespace isa_scalar {
void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
}
namespace isa_avx2 {
void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
}

// Rows of x up to this many read the packed codes directly; more rows first
// convert a panel of weight rows' codes to fp32 once (same arithmetic either way).
constexpr int64_t kDirectMaxRows = 4;

// Horizontal sum of 8 lanes in the fixed order above.
inline float hsum8(const float v[8]) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

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
