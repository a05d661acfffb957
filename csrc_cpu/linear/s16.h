// The s16 weight layout of the quantized linear: int8 codes with one float
// scale (and optionally one float offset) per 16 weights of a row,
// w = d[n, k/16] * q[n, k] + m[n, k/16]. Every GGUF type whose scales are
// finer than 32 weights (Q2_K, Q3_K, Q6_K) or whose codes have 5 bits (Q5_1,
// Q5_K) unpacks into it exactly (core/models/loaders/quant_layouts.py), and
// so does every other layout (a fused matrix whose rows come in several
// types). The codes may be packed into 2-6 bits (below, "Packed codes").
//
// It runs on the int8 paths only (activations "int8" / "int8x2"; float32
// activations dequantize it and take the dense GEMM). x is quantized as for
// every int8 path (int8.h: codes c = xq, or c = 256 * xq + lo with int8x2's
// low term, and per 32-block scale dx, the low scale for int8x2 rows). Per
// output (r, n), two chains e[0] = e[1] = +0, one for the first half of
// every 32-block and one for the second:
//   for every 32-block b, in order, and its halves h = 0, 1 (g = 2b + h):
//     I    = sum of W[n, k] * c[r, k] over the half's 16 elements   (int32, exact)
//     e[h] = fma(fl(d[n, g] * dx[r, b]), float(I), e[h])
//   out = fl(e[0] + e[1])
//   with offsets: eight chains t[j] = +0, then over every half g in order
//     t[g % 8] = fma(m[n, g], xs[r, g], t[g % 8]),  xs[r, g] = fl(dx[r, g/2] * float(sum of c over the half))
//   and out = fl(out + hsum8(t)) (quant_linear.h's order: 1/16 of the
//   products, so a separate pass over m's rows costs less than a step in
//   the chains per half)
// The fp32 work is two steps per 32 products, not one per 4: prompt rows
// run 8 weight rows per vector (int16 pair panels, kernel_s16_avx2.cpp), and
// a row's 8 lane sums reduce to its two half sums among 4 outputs at once
// (two chains, so a vector holds both halves of 4 outputs). float(I) is
// exact while |I| < 2^24: codes |q| <= 32 (every GGUF type s16 holds) times
// |c| <= 32639 over 16 elements; wider codes (a fused matrix's q8 rows) round
// it to nearest, the same on every path. A row's outputs depend only on the
// row and the weight: bitwise the same alone or in any call, any thread
// count and every build (the scalar build is the definition; the AVX2 build,
// which the x86 builds share but avx512 and amx, and the AVX-512 VNNI build
// reproduce it).
#pragma once

#include <cstdint>

#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int64_t kS16Half = 16;  // weights per scale

// The order of x's codes in S16Args::c16, per 32-block: A, the first pair
// of each lane (elements 4l, 4l+1), then B, the second pairs (4l+2, 4l+3),
// each as 16 int16 with the lanes in this order. It is what two vpmaddwd
// make of a block's codes widened and split by vshufps (lanes 0, 1 | 2, 3
// from elements 0-15, 4, 5 | 6, 7 from 16-31): madd(wA, cA) + madd(wB, cB)
// is the lanes' sums I (exact in int32), in this order.
constexpr int kS16PairLanes[kLanes] = {0, 1, 4, 5, 2, 3, 6, 7};
// A row's codes c (xq, or 256 xq + lo where lo is given) as int16 [K] in
// the pair order above. Also the x of the AVX2 int8 build's q8_0 pair tiles
// (int8.h, LinearArgs::x16).
// (Inline: the int8 kernels of every build call it.)
inline void pair_codes(const int8_t* hi, const int8_t* lo, int64_t K, int16_t* c16) {
  for (int64_t b = 0; b < K; b += kBlock)
    for (int p = 0; p < kLanes; ++p)
      for (int e = 0; e < 4; ++e) {  // elements 0, 1 of the lane: pair A; 2, 3: pair B
        const int64_t k = b + 4 * kS16PairLanes[p] + e;
        c16[b + (e / 2) * (kBlock / 2) + 2 * p + e % 2] = int16_t(lo ? hi[k] * 256 + lo[k] : hi[k]);
      }
}
// Calls of at most this many rows get no c16 (null): the AVX2 kernel reads
// their codes as they lie (too few rows to pay for a panel of int16 pairs;
// measured at 1-9 rows, docs/cpu-linear.md).
constexpr int64_t kS16FewRows = 8;

// Packed codes (LinearArgs::code_bits 2 to 6; qtype "s16.u5" and the
// like at the boundary; K a multiple of 256): a code q is held as u = q +
// code_bias, 0 <= u < 2^bits, and each group of 256 weights of a row (8
// blocks of 32) as 32 * bits bytes: B 32-byte vectors of the low B bits
// (B = 4 from 4 bits, 2 below: s16_base_bits; vector i, byte l: block
// (8/B) i + j's element l at bit B j, so nibbles for B = 4), then H = bits
// - B vectors of high bits (u >> B of block j's element l in byte l of
// vector j / (8/H), at bit H * (j % (8/H))). One vector load then serves
// 8/B blocks' low bits and one high vector 8/H blocks' high bits (an and
// and a shift per block, whatever the width).
// Q2_K's codes 0..3 take 2 bits, Q3_K's -4..3 three (bias 4), Q5_K's 0..31
// five (0.63 bytes a weight against the int8 byte), Q6_K's -32..31 six
// (bias 32). Calls of more than kS16FewRows rows
// never see them: the driver unpacks each work item's rows into the calling
// thread's int8 scratch just before the kernel runs (s16.cpp); a build whose
// table says s16_packed_few_rows reads them directly in calls of fewer
// rows (the AVX2 kernel: vpmaddubsw on u, then bias * the half sums of x,
// S16Args::half_bias, subtracted: the same exact int32 sums). Every build
// computes the bits of the int8 form.
// Rows whose K is not a multiple of 256 (llama.cpp's Q5_1 / Q5_0 fallback
// rows) pack 5-bit codes per 32-block instead ("s16.u5b", "s16.s5b";
// LinearArgs::code_blocks): q8_packed.h's 20-byte blocks, u = q + bias,
// which the x86 few-rows kernel reads in place (BlockCodes) and every other
// path unpacks per work item.
//
// Half-pair scales (LinearArgs::d16 / m16, fp16 [N, K/32]): where each
// block's two halves share one fp16 scale (and offset), as Q5_1's and
// Q5_0's do, and K is not a multiple of 256 (no compact scales there), the
// values are kept once per block; the drivers widen each work item's rows
// to the float32 per-16 values (exact). 0.75 bytes a Q5_1 weight instead of
// 1.5 with byte codes and float32 scales.
constexpr int64_t kS16PackedGroup = 256;  // weights per group of packed codes
constexpr int64_t s16_packed_group_bytes(int bits) { return 32 * bits; }
// The low bits of a packed code that lie in the group's first vectors (above).
constexpr int s16_base_bits(int bits) { return bits >= 4 ? 4 : 2; }

// Block j's element l of a packed group (above): u = q + bias.
inline int s16_packed_code(const uint8_t* group, int bits, int j, int l) {
  const int B = s16_base_bits(bits), H = bits - B;
  int u = (group[32 * (j / (8 / B)) + l] >> (B * (j % (8 / B)))) & ((1 << B) - 1);
  if (H > 0) u |= ((group[32 * B + 32 * (j / (8 / H)) + l] >> (H * (j % (8 / H)))) & ((1 << H) - 1)) << B;
  return u;
}

// Rows [0, rows) of packed codes into int8 [rows, K] (the definition; the
// x86 builds' Kernels::s16_unpack gives the same bytes).
inline void unpack_s16_rows(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out) {
  const int64_t group_bytes = s16_packed_group_bytes(bits);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t g = 0; g < K / kS16PackedGroup; ++g) {
      const uint8_t* src = packed + (n * (K / kS16PackedGroup) + g) * group_bytes;
      int8_t* dst = out + n * K + g * kS16PackedGroup;
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < kBlock; ++l) dst[j * kBlock + l] = int8_t(s16_packed_code(src, bits, j, l) - bias);
    }
}

// Row `codes` [K] (each inside the form's range) packed as above into out
// (row_bytes; the definition, as unpack_s16_rows).
inline void pack_s16_row(const int8_t* codes, int64_t K, int bits, int bias, uint8_t* out) {
  const int B = s16_base_bits(bits), H = bits - B;
  const int64_t group_bytes = s16_packed_group_bytes(bits);
  for (int64_t i = 0; i < K / kS16PackedGroup * group_bytes; ++i) out[i] = 0;
  for (int64_t g = 0; g < K / kS16PackedGroup; ++g) {
    uint8_t* group = out + g * group_bytes;
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < kBlock; ++l) {
        const int u = (codes[g * kS16PackedGroup + j * kBlock + l] + bias) & ((1 << bits) - 1);
        group[32 * (j / (8 / B)) + l] |= uint8_t((u & ((1 << B) - 1)) << (B * (j % (8 / B))));
        if (H > 0) group[32 * B + 32 * (j / (8 / H)) + l] |= uint8_t((u >> B) << (H * (j % (8 / H))));
      }
  }
}

// One-term calls of more than kS16FewRows rows on a build whose table says
// s16_byte_tiles (the AVX-512 VNNI kernel) take no c16: the kernel
// multiplies unsigned bytes u = q + kS16ByteBias (any int8 code fits) by
// x's int8 codes as they lie (vpdpbusd, 4 products a lane where a pair of
// int16 takes 2) and subtracts half_bias = kS16ByteBias * the half sums of
// c: the same exact int32 sums.
constexpr int32_t kS16ByteBias = 128;

// One call's operands: the weight (a.qs, a.d / a.m [N, K/16]), its int8
// codes (row n at codes + (n - codes_row0) * K: a.qs itself, or the rows a
// driver unpacked from packed codes), x quantized (a.x8, a.x8_lo,
// a.x8_scale as int8.h), its codes c as int16 in the pair order above (c16
// [M, K], for calls of more than kS16FewRows rows), the half sums xs [M,
// K/16] when the weight has offsets, half_bias (below), and the output.
struct S16Args {
  const LinearArgs* a;
  const float* xs = nullptr;
  // [M, K/16] bias * the half's sum of c: code_bias for packed codes read
  // in place (the few-rows kernel multiplies u = q + bias, then subtracts
  // it), kS16ByteBias for the byte tiles
  const int32_t* half_bias = nullptr;
  const int16_t* c16 = nullptr;
  const int8_t* codes = nullptr;
  int64_t codes_row0 = 0;
  const int8_t* row_codes(int64_t n) const { return codes + (n - codes_row0) * a->K; }
};

// What a row group of a call (rows of x, with or without int8x2's low
// term) gets from the driver for build k's kernel: whether the kernel reads
// packed codes in place, the bias its half sums carry in half_bias (0:
// none), and whether it reads c16.
// With persistent panels (a.panels, the avx512 build's) calls of up to
// s16_panel_rows() rows read them in place (their few-rows kernel, in passes
// of x rows over each column), more take the tiles; same bits either way.
// Where the two cross is the core's (1B shapes): Zen 4, the few-rows kernel
// 1.5-1.8x the tiles at 9-16 rows, 1.1-1.25x at 48, even at 64-128 (48);
// Ice Lake, 1.3-1.7x at 9 rows, even at 12, 0.9-0.95x at 16, 0.6-0.8x at
// 32-48 (12). So 48 on AMD, 12 elsewhere; PAGED_S16_PANEL_ROWS (read once)
// or set_s16_panel_rows overrides it.
int64_t s16_panel_rows();
// rows in [kS16FewRows, kS16MaxPanelRows], or 0 for the CPU's default; set
// between calls (a call reads it while it plans its row groups)
void set_s16_panel_rows(int64_t rows);
constexpr int64_t kS16MaxPanelRows = 4096;
inline int64_t s16_few_rows_limit(const LinearArgs& a) { return a.panels ? s16_panel_rows() : kS16FewRows; }
inline bool s16_reads_packed(const Kernels& k, const LinearArgs& a, int64_t rows) {
  // (codes packed per 32-block have no panels: the few-rows kernel reads them up to kS16FewRows rows)
  return k.s16_packed_few_rows && rows <= (a.code_blocks ? kS16FewRows : s16_few_rows_limit(a)) && a.code_bits < 8;
}
inline int32_t s16_group_bias(const Kernels& k, const LinearArgs& a, int64_t rows, bool two_terms) {
  if (s16_reads_packed(k, a, rows)) return a.code_bias;
  return k.s16_byte_tiles && rows > s16_few_rows_limit(a) && !two_terms ? kS16ByteBias : 0;
}
inline bool s16_reads_c16(const Kernels& k, const LinearArgs& a, int64_t rows, bool two_terms) {
  return rows > s16_few_rows_limit(a) && !s16_group_bias(k, a, rows, two_terms);
}

namespace isa_scalar {
void s16_rows(const S16Args& s, int64_t n0, int64_t n1);
}
namespace isa_avx2 {  // arch/x86/linear/kernel_s16_avx2.cpp
void s16_rows(const S16Args& s, int64_t n0, int64_t n1);
void s16_unpack(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out);
}
namespace isa_avx512 {  // arch/x86/linear/kernel_s16_avx512.cpp (VNNI)
void s16_rows(const S16Args& s, int64_t n0, int64_t n1);
// Persistent panels of packed codes (arch/x86/linear/s16_panels_avx512.cpp;
// Kernels::panel_chunk_bytes and the like for qtype s16): a chunk's bytes,
// its build and its inverse (back into a's packed codes and scales), and
// the few-rows kernel on them (a.panels).
int64_t s16_panel_chunk_bytes(const LinearArgs& a, PanelScales form);
void s16_build_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst);
void s16_unpack_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, const uint8_t* src);
void s16_panel_few_rows(const S16Args& s, int64_t n0, int64_t n1);
}

// The int8 / int8x2 linear on an s16 weight: rows [0, two_rows) with the low term.
void s16_linear(LinearArgs& a, int64_t two_rows);
// w into out [N, K] (a.out), fl(d * q) then + m, as gguf computes it.
void s16_dequantize(const LinearArgs& a, float* out);
// The s16 kernel of the active linear build (its table entry, kernel_builds.cpp).
S16Kernel s16_kernel();

}  // namespace paged::cpu::linear
