// The NEON builds' int8-path panel (aarch64 only; int8.h): a work item's
// weight rows (<= kI8ChunkRows) widened once into the thread's panel as
// signed codes [row][K], with d (and m) transposed to [block][kPanelRows] so
// that one vector holds 4 rows' scales; and the fp32 step of one block for 4
// outputs, the scalar build's order: acc = fma(fl(d * dx), float(isum), acc),
// then for q4_1 acc = fma(m, xs, acc). Shared by kernel_i8_neon.inc (neon,
// dotprod: one x row at a time) and kernel_i8_i8mm.cpp (two x rows).
#pragma once

#include <arm_neon.h>

#include <algorithm>

#include "linear/int8.h"
#include "arch/arm/linear/neon_codes.h"

namespace paged::cpu::linear::neon {

constexpr int64_t kPanelRows = kI8ChunkRows;

inline void build_panel(const LinearArgs& a, int64_t n0, int64_t rows, Int8Panel& panel) {
  const int64_t nb = a.blocks(), K = a.K;
  panel.codes.resize(size_t(kPanelRows * K));
  panel.d.assign(size_t(nb * kPanelRows), 0.f);
  panel.m.assign(a.m ? size_t(nb * kPanelRows) : 0, 0.f);
  int8_t* codes = reinterpret_cast<int8_t*>(panel.codes.data());
  for (int64_t i = 0; i < kPanelRows; ++i) {
    int8_t* dst = codes + i * K;
    if (i >= rows) {  // padding rows: zero codes and scales, outputs not stored
      std::fill(dst, dst + K, int8_t(0));
      continue;
    }
    const uint8_t* row = a.qs + (n0 + i) * a.row_bytes();
    for (int64_t b = 0; b < nb; ++b) {
      const Codes8 c = block_codes(a.qtype, row, b);
      vst1q_s8(dst + b * kBlock, c.lo);
      vst1q_s8(dst + b * kBlock + 16, c.hi);
      panel.d[size_t(b * kPanelRows + i)] = a.d[(n0 + i) * nb + b];
      if (a.m) panel.m[size_t(b * kPanelRows + i)] = a.m[(n0 + i) * nb + b];
    }
  }
}

// Block b's step for panel rows j .. j+3 of x row r (isum: their exact sums).
inline float32x4_t block_step(float32x4_t acc, int32x4_t isum, const LinearArgs& a, const Int8Panel& panel,
                              int64_t b, int64_t j, int64_t r) {
  const int64_t nb = a.blocks();
  const float32x4_t scale = vmulq_n_f32(vld1q_f32(panel.d.data() + b * kPanelRows + j), a.x8_scale[r * nb + b]);
  acc = vfmaq_f32(acc, scale, vcvtq_f32_s32(isum));
  if (a.m) acc = vfmaq_n_f32(acc, vld1q_f32(panel.m.data() + b * kPanelRows + j), a.x8_sum[r * nb + b]);
  return acc;
}

// Outputs n0 + j .. n0 + j + 3 of x row r, those below `rows`.
inline void store4(const LinearArgs& a, float32x4_t acc, int64_t r, int64_t n0, int64_t j, int64_t rows) {
  float out[4];
  vst1q_f32(out, acc);
  for (int64_t i = 0; i < 4 && j + i < rows; ++i) a.out[r * a.N + n0 + j + i] = out[i];
}

}  // namespace paged::cpu::linear::neon
