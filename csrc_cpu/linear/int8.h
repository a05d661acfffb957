// The int8-activation path of the quantized linear (activations="int8";
// contract: docs/kernels.md, "Quantized linear (CPU)"): x quantized per
// 32-block to int8 as llama.cpp's q8 activations, integer dot products with the
// weight codes, then one fixed float order per output. A row's outputs depend
// only on that row and the weight, so they are bitwise the same alone or in a
// call of any M, on any thread count and in every ISA build.
//
// Quantization of x, per row r and block b of 32 values (x8_quantize: each
// build in its own vectors, all bitwise equal: a maximum, an IEEE division,
// clamping and rounding to nearest even are exact operations):
//   amax     = max_k |x[r, 32b+k]|                       (a NaN sticks)
//   dx[r,b]  = amax / 127                                  (fp32 division)
//   xq[r,k]  = round_half_even(clamp(x[r,k] / dx, -127, 127))   (fp32 division)
// xq is 0 wherever dx == 0 (an all-zero block, or amax < 127 * 2^-150 so the
// division underflows); such a block adds exactly 0. A block holding a NaN or
// an inf gets dx = NaN and codes 0, so every output of its row is NaN.
//
// Per output (r, n), over b = 0, 1, ... in order, from acc = +0:
//   isum = sum_k W[n, 32b+k] * xq[r, 32b+k]         exact int32 (any order)
//   acc  = fma(fl(d[n,b] * dx[r,b]), float(isum), acc)
//   q4_1: acc = fma(m[n,b], xs[r,b], acc),  xs[r,b] = fl(dx[r,b] * float(sum_k xq[r,32b+k]))
// and out = acc. W is the integer code: q - 8 (q4_0), q (q4_1: w = d*q + m),
// the int8 code (q8_0). |isum| <= 32 * 128 * 127 < 2^24 and |sum xq| <= 4064, so
// both conversions to float are exact. Q4_1's offsets multiply the block sums
// of the quantized x (as llama.cpp's q8_1), so out is, to fp32 rounding, the
// dequantized weight times x_hat = dx * xq.
//
// int8x2 (two terms, ~15 bits of x): after the quantization above, per block
//   s        = fl(dx * 2^-8)                                (exact unless dx is subnormal)
//   lo[r,k]  = round_half_even(clamp(fl(x - fl(dx * xq)) / s, -127, 127))   (0 where s == 0)
// so x ~ s * c with the 16-bit code c = 256 * xq + lo (|x - s c| <= s/2, or
// <= s where the residual reaches dx/2 and lo is clamped). Per block the
// kernels form isum = isum(xq) * 256 + isum(lo) = sum_k W * c, exact in int32
// (|isum| <= 32 * 128 * 32639 < 2^31), and run the steps below with dx := s
// and xs := fl(s * float(sum c)) (|sum c| < 2^24: exact); float(isum) is
// then rounded (|isum| may exceed 2^24), the same way in every build. The low
// codes are computed once per call by the build's x8_low_term: the plain C++
// definition (kernel_i8_scalar.cpp) or avx512's bitwise twin.
//
// The SIMD builds multiply unsigned weight codes by the signed x codes
// (vpdpbusd, vpmaddubsw): u = q (4-bit) or q8 + 128, so isum = sum u * xq +
// corr with corr[r,b] = -off * sum_k xq (off 8 for q4_0, 128 for q8_0, 0 for
// q4_1), computed with the quantization, once per call, and used as the int32
// accumulator's starting value.
#pragma once

#include <cstdint>

#include "linear/aligned.h"
#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int32_t kI8Max = 127;  // x codes lie in [-kI8Max, kI8Max]
constexpr float kI8LowScale = 1.f / 256.f;  // int8x2: the low term's scale is dx * kI8LowScale
// round_half_even(v) for |v| <= 2^22: adding 1.5 * 2^23 leaves no fraction
// bits, so the default rounding mode rounds v to an integer (ties to even);
// subtracting it back is exact. Vectorizes, unlike lrint.
constexpr float kI8RoundMagic = 12582912.f;
// Weight rows per OpenMP work item of the int8 path; a kernel call gets at
// most this many (a multiple of every build's panel width).
constexpr int64_t kI8ChunkRows = 32;

// Pair tiles (Kernels::pair_tiles: the AVX2 build): for int8x2 calls of at
// least pair_min_rows(t) rows, the caller also lays out each row's c = 256 *
// xq + lo as int16 (LinearArgs::x16, s16.h's pair_codes), and the kernel
// multiplies int16 pairs of the signed weight codes (q - 8, q, q8) by pairs
// of c (vpmaddwd: |pair| <= 2 * 128 * 32639), one product for both terms:
// the same exact isum. Fewer rows, and int8's one term, multiply the bytes.
// The bounds are measured (docs/cpu-linear.md, "Builds"): q8_0 gains from 4
// rows (its byte form costs twice the ops), the 4-bit types only on the
// panel path (more than 8 rows).
constexpr int64_t pair_min_rows(QType t) { return t == QType::Q8_0 ? 4 : 9; }

// With persistent panels read in place (the avx512 build's 4-bit q4_0 /
// q4_1, and q8_0's packed codes: q8_0.s5, q8_0.nl4) calls of up to
// nibble_panel_rows() rows read them column by column (nibble_columns, in
// passes of 2 x rows), more take the tiles; same bits.
// The core's crossover, as s16's (s16.h): Zen 4 keeps the passes to 8 rows
// (measured there against the calls without panels, not against these
// tiles); on Ice Lake the tiles equal them at 1 row and win from 2 (1B
// shapes: 1.0-1.1x at 2 rows, 1.2-1.3x at 3, 1.4-1.75x at 4, 2x at 8;
// engine, 4 / 8 streams: Q4_K_M 1.44x / 1.74x, IQ4_XS 1.1x / 1.4x). So 8 on AMD, 1 elsewhere;
// PAGED_NIBBLE_PANEL_ROWS (read once) or set_nibble_panel_rows overrides it.
constexpr int64_t kNibbleMaxPanelRows = 8;
int64_t nibble_panel_rows();
// rows in [1, kNibbleMaxPanelRows], or 0 for the CPU's default; set between calls
void set_nibble_panel_rows(int64_t rows);

// Rows past M that the quantized x (x8, and x8_lo for its rows) must have
// readable: the AMX build's tiles load 16 rows at a time, and the sums of the
// rows past M are never used, so their values do not matter.
constexpr int64_t kI8PadRows = 16;

// Offset subtracted from the unsigned codes the SIMD builds multiply (see above).
constexpr int32_t unsigned_offset(QType t) { return t == QType::Q4_0 ? 8 : (t == QType::Q8_0 ? 128 : 0); }

// Row r of x quantized as above into codes[K], and per block dx[K/32],
// corr[K/32] = -unsigned_offset(t) * sum xq, xs[K/32] = dx * float(sum xq).
// Int8Quantize in quant_linear.h; one per build (namespaces below).

// A thread's weight panel: a chunk's codes widened to bytes in the build's
// interleaved layout, and its scales (and q4_1 offsets) transposed, built once
// per call and swept by every row of x.
struct Int8Panel {
  AlignedVector<uint8_t> codes;
  AlignedVector<float> d, m;
  // avx512: the persistent 4-bit chunk whose nibbles `codes` holds widened;
  // the owner resets it at every chunk (a panel's memory may be reused).
  const uint8_t* widened = nullptr;
};

// The builds (listed, with what each needs, in kernel_builds.cpp): the
// scalar definition here (kernel_i8_scalar.cpp), x86-64's in arch/x86/linear
// and arch/x86/amx, aarch64's in arch/arm/linear.
namespace isa_scalar {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs);
void x8_low_term(const float* x, int64_t K, QType t, const int8_t* hi, int8_t* lo, float* dx, int32_t* lo_corr,
                 float* xs);
}
namespace isa_avx2 {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs);
}
namespace isa_avxvnni {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
}
namespace isa_avx512 {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
// The persistent panel (weight_panels.h): bytes per chunk of kI8ChunkRows
// weight rows, and chunk [n0, n1)'s panel built into dst (64-byte aligned),
// exactly what int8_rows builds into its scratch per call.
int64_t panel_chunk_bytes(const LinearArgs& a, PanelScales scales);  // s16's: s16.h
void build_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst);
void unpack_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, const uint8_t* src);
void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs);
void x8_low_term(const float* x, int64_t K, QType t, const int8_t* hi, int8_t* lo, float* dx, int32_t* lo_corr,
                 float* xs);
}
// AMX-INT8 tiles for the block sums (arch/x86/amx/kernel_i8_amx.cpp); the VNNI build's
// panels, quantizer and low term, and its kernels for calls of few rows.
namespace isa_amx {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
}
// aarch64 (arch/arm/linear/kernel_i8_neon.inc, kernel_i8_dotprod.cpp,
// kernel_i8_i8mm.cpp); all quantize x with isa_scalar::x8_quantize.
namespace isa_neon {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
}
namespace isa_dotprod {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
}
namespace isa_i8mm {
void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
}

}  // namespace paged::cpu::linear
