// Weight codes of one GGUF block as NEON vectors (aarch64 only): the 32
// signed integer codes of block_code() (quant_linear.h) as two int8x16
// halves, elements 0-15 and 16-31. Shared by the NEON builds of both paths.
#pragma once

#include <arm_neon.h>

#include "linear/quant_linear.h"

namespace paged::cpu::linear::neon {

struct Codes8 {
  int8x16_t lo, hi;  // elements 0-15, 16-31
};

// 4-bit types: byte k & 15 holds element k (low nibble) and k + 16 (high);
// Q4_0's codes are q - 8.
inline Codes8 block_codes(QType t, const uint8_t* row, int64_t b) {
  if (t == QType::Q8_0) {
    const int8_t* p = reinterpret_cast<const int8_t*>(row + b * kBlock);
    return {vld1q_s8(p), vld1q_s8(p + 16)};
  }
  const uint8x16_t bytes = vld1q_u8(row + b * (kBlock / 2));
  int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0F)));
  int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
  if (t == QType::Q4_0) {
    lo = vsubq_s8(lo, vdupq_n_s8(8));
    hi = vsubq_s8(hi, vdupq_n_s8(8));
  }
  return {lo, hi};
}

// 16 int8 codes as 4 float32x4 (exact).
inline void widen(int8x16_t v, float32x4_t out[4]) {
  const int16x8_t a = vmovl_s8(vget_low_s8(v)), b = vmovl_high_s8(v);
  out[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
  out[1] = vcvtq_f32_s32(vmovl_high_s16(a));
  out[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)));
  out[3] = vcvtq_f32_s32(vmovl_high_s16(b));
}

}  // namespace paged::cpu::linear::neon
