// Int8 matrix-multiply (ARMv8.6 i8mm, smmla) build of the int8 path, aarch64
// only, chosen where HWCAP2 reports i8mm (Graviton 3, Neoverse V1/N2, Apple
// M2; also dotprod, which every such core has). smmla multiplies a 2 x 8
// block of x codes (two rows) by an 8 x 2 block of weight codes (two weight
// rows) into a 2 x 2 int32 tile, exact; four of them cover a 32-code block.
// So this build takes x rows in pairs (an odd last row pairs with zeros,
// whose outputs are not stored) and weight rows in fours (two tiles), then
// runs the scalar build's fp32 steps per output (neon_panel.h): bitwise the
// scalar build. With M = 1 half of each tile is padding; decode is bandwidth
// bound either way, prefill gains the halved instruction count.
#include <arm_neon.h>

#include <algorithm>

#include "arch/arm/linear/neon_panel.h"
#include "arch/target.h"

PAGED_TARGET_BEGIN(PAGED_TARGET_ARM_I8MM)

namespace paged::cpu::linear::isa_i8mm {
namespace {

// [x0[k:k+8], x1[k:k+8]] for k = 0, 8, 16, 24 of a 32-code block of two rows.
inline void row_pairs(const int8_t* x0, const int8_t* x1, int8x16_t out[4]) {
  for (int h = 0; h < 2; ++h) {
    const int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(x0 + 16 * h));
    const int64x2_t b = vreinterpretq_s64_s8(vld1q_s8(x1 + 16 * h));
    out[2 * h] = vreinterpretq_s8_s64(vzip1q_s64(a, b));
    out[2 * h + 1] = vreinterpretq_s8_s64(vzip2q_s64(a, b));
  }
}

// The 2 x 2 tile [x0.w0, x0.w1, x1.w0, x1.w1] of one block.
inline int32x4_t tile(const int8x16_t xp[4], const int8_t* w0, const int8_t* w1) {
  int8x16_t wp[4];
  row_pairs(w0, w1, wp);
  int32x4_t acc = vdupq_n_s32(0);
  for (int k = 0; k < 4; ++k) acc = vmmlaq_s32(acc, xp[k], wp[k]);
  return acc;
}

}  // namespace

void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel) {
  const int64_t nb = a.blocks(), K = a.K;
  const int64_t rows = std::min(n1 - n0, neon::kPanelRows);
  neon::build_panel(a, n0, rows, panel);
  const int8_t* codes = reinterpret_cast<const int8_t*>(panel.codes.data());
  alignas(16) static const int8_t kZeros[kBlock] = {};
  for (int64_t r = 0; r < a.M; r += 2) {
    const bool pair = r + 1 < a.M;
    for (int64_t j = 0; j < rows; j += 4) {
      const int8_t* w = codes + j * K;
      float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = vdupq_n_f32(0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* wb = w + b * kBlock;
        // The 2 x 4 sums of block b, rows r and r + 1 of codes x, weight rows j .. j+3.
        const auto sums = [&](const int8_t* x, int32x4_t& t01, int32x4_t& t23) {
          int8x16_t xp[4];
          row_pairs(x + r * K + b * kBlock, pair ? x + (r + 1) * K + b * kBlock : kZeros, xp);
          t01 = tile(xp, wb, wb + K);              // rows n, n+1
          t23 = tile(xp, wb + 2 * K, wb + 3 * K);  // rows n+2, n+3
        };
        int32x4_t s01, s23;
        sums(a.x8, s01, s23);
        if (a.x8_lo) {  // int8x2: hi * 256 + lo
          int32x4_t l01, l23;
          sums(a.x8_lo, l01, l23);
          s01 = vaddq_s32(vshlq_n_s32(s01, 8), l01);
          s23 = vaddq_s32(vshlq_n_s32(s23, 8), l23);
        }
        const int64x2_t t01 = vreinterpretq_s64_s32(s01), t23 = vreinterpretq_s64_s32(s23);
        acc0 = neon::block_step(acc0, vreinterpretq_s32_s64(vzip1q_s64(t01, t23)), a, panel, b, j, r);
        if (pair) acc1 = neon::block_step(acc1, vreinterpretq_s32_s64(vzip2q_s64(t01, t23)), a, panel, b, j, r + 1);
      }
      neon::store4(a, acc0, r, n0, j, rows);
      if (pair) neon::store4(a, acc1, r + 1, n0, j, rows);
    }
  }
}

}  // namespace paged::cpu::linear::isa_i8mm

PAGED_TARGET_END()
