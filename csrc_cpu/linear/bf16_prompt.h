// Prompt rows in bfloat16 on AMX-BF16 tiles (contract: docs/kernels.md,
// "bfloat16 prompt rows (mixed-bf16)").
//
//   out[r, n] = sum over k of bf16(x[r, k]) * bf16(W[n, k]), float32 sums
//
// bf16() is round-to-nearest-even, NaN -> 0x7FC0 (torch's conversion); W is
// the dequantized GGUF weight (quant_dequantize's float32 values). Each
// output is a chain of tdpbf16ps over K in steps of 32 (C += A . B per step,
// from C = 0), so a row's bits depend on that row, the weight and the
// build only: bitwise the same alone or in a call of any M, any thread count
// (batch invariant). tdpbf16ps's summation inside a step is the unit's own
// (not a sequential or pairwise order; it treats bf16 subnormals as zero and
// rounds to nearest even), so no scalar twin is bitwise: the check is a
// float64 bound (tests/test_bf16_prompt.py).
//
// The weight lives in its own copy, the tile layout: N rounded up to
// kBf16Cols (zero rows past N), and per 16 output rows c16 and step s
// (K / 32 of them) one 1 KB B tile of 16 rows (k pairs) x 16 columns (n) x 2:
// element [c16][s][kk][n][j] = bf16(W[16 c16 + n][32 s + 2 kk + j]).
#pragma once

#include <cstdint>

#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int64_t kBf16Cols = 32;  // output columns per work item (two B tiles of 16)
constexpr int64_t kBf16Rows = 32;  // x rows per work item (two A tiles of 16)
constexpr int64_t kBf16Step = 32;  // K per tdpbf16ps

// Elements of the tile-layout copy of an [N, K] weight.
inline int64_t bf16_weight_elems(int64_t N, int64_t K) {
  return (N + kBf16Cols - 1) / kBf16Cols * kBf16Cols * K;
}

// One call: x packed as [groups of 32 rows][K / 32][32 rows][32] bf16
// (rows past M zero), the weight in the tile layout, out [M, N] float32.
struct Bf16Args {
  int64_t M = 0, N = 0, K = 0;
  const uint16_t* x = nullptr;
  const uint16_t* w = nullptr;
  float* out = nullptr;
  int64_t groups() const { return (M + kBf16Rows - 1) / kBf16Rows; }
  int64_t chunks() const { return (N + kBf16Cols - 1) / kBf16Cols; }
};

// The kernels of one build (kernel_builds.h: bf16_prompt_rows).
struct Bf16Kernels {
  // Group g (rows 32 g .. 32 g + 31, zeros past M) of x [M, K] into the packed layout above.
  void (*pack_group)(const float* x, int64_t M, int64_t K, int64_t g, uint16_t* packed);
  // Work item i of a call whose weight is in the tile layout (bf16_linear).
  void (*item)(const Bf16Args& a, int64_t i);
  // out[:, n0:n1] of a's rows from chunk [n0, n1)'s int8 panel of the
  // quantized weight w (built into, or viewed through, the thread's `panel`).
  void (*panel_rows)(const Bf16Args& a, const LinearArgs& w, int64_t n0, int64_t n1, Int8Panel& panel);
};

// Rows x [M, K] (float32) packed as Bf16Args::x wants by the build's
// pack_group, into the calling thread's buffer (kept between calls; valid
// until its next call), groups split over the threads when `parallel`.
const uint16_t* pack_bf16_rows(const Bf16Kernels& k, const float* x, int64_t M, int64_t K, bool parallel);

// The AMX build (arch/x86/amx/kernel_bf16_amx.cpp).
namespace isa_amx_bf16 {
// Group g (rows 32 g .. 32 g + 31, zeros past M) of x [M, K] into the packed layout above.
void pack_group(const float* x, int64_t M, int64_t K, int64_t g, uint16_t* packed);
// Work item i: group i % groups, chunk i / groups (chunk-major: a thread's
// consecutive items share the chunk's weight tiles); a.w is the tile layout.
void item(const Bf16Args& a, int64_t i);
}  // namespace isa_amx_bf16
namespace isa_avx512 {
struct PanelView;
}
namespace isa_amx_bf16 {
// out[:, n0:n1] for all of a's rows (a.w unused) from chunk [n0, n1)'s int8
// weight panel p (int8_avx512.h): its B tiles are made from the panel's
// codes and scales (dequantized as quant_dequantize does, rounded as torch
// does), then swept by every group; bitwise `item` on build_bf16_weight's
// copy of the same weight (tests/test_bf16_prompt.py).
void panel_rows(const Bf16Args& a, const isa_avx512::PanelView& p, QType t, int64_t n0, int64_t n1);
}  // namespace isa_amx_bf16

// The Python entry points are in ops.h.

}  // namespace paged::cpu::linear
