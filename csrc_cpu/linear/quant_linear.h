// Linear layers on GGUF-packed weights (Q4_0 / Q4_1 / Q8_0) (contract:
// docs/kernels.md, "Quantized linear (CPU)"). Two arithmetic paths, chosen by
// the number of rows M of x in the call (kInt16MaxRows):
//
// int16 path (M <= kInt16MaxRows; unpacking 4-bit codes to fp32 lanes would
// dominate at so few rows). Once per call, each row r of x is quantized per
// 32-element block b:
//   s      = max|x[r, b's elements]| / 32767       (fp32 division; 0 for a zero block)
//   hi[k]  = clamp(round_half_even(x[k] / s), +-32767)           (fp32 division)
//   res[k] = fma(-s, hi[k], x[k])                  (exact: |res| <= s/2, see quantize_block)
//   s_lo   = s * 2^-16                             (exact unless s is subnormal)
//   lo[k]  = clamp(round_half_even(res[k] / s_lo), +-32767)      (fp32 division)
// so x[k] = s * hi[k] + s_lo * lo[k] up to s_lo/2 (s_lo at a clamped tie),
// ~2^-32 of the block's largest value: below fp32 rounding. Per block b, lane l < 8:
//   I[l]   = sum of Q[k] * hi[k] over k in {2l, 2l+1, 16+2l, 17+2l}   (int32, exact)
//   L[l]   = the same sum of Q[k] * lo[k]                              (int32, exact)
//   t      = fma(float(L[l]), s_lo, s * float(I[l]))  (the product rounded on its own)
//   acc[l] = fma(d_b, t, acc[l])
// |I|, |L| <= 4 * 128 * 32767 < 2^24, so float(I) and float(L) are exact (and
// vpmaddwd's pair sums cannot overflow: no code is -32768). The lanes are
// those of AVX2's vpmaddwd on the codes of elements 0-15 and 16-31.
//
// fp32 path (M > kInt16MaxRows; 4 fmas per block-row beat ~11 integer ops).
// Per block b, lane l < 8, on the fp32 x and the codes as floats:
//   t      = Q[l]*x[l]; t = fma(Q[8+l], x[8+l], t); ... (+16, +24)
//   acc[l] = fma(d_b, t, acc[l])
//
// Both paths then add Q4_1's offsets, sm = fma(m_b, xs[r, b], sm) in block
// order, and out = hsum8(acc) + sm, where Q are the integer codes (q - 8 for
// Q4_0), xs[r, b] = hsum8 of the lane sums of x over block b and hsum8 is
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). Within a path, every output is
// evaluated in this one order whatever M, the row tiling, the thread count or
// the ISA (the scalar builds emulate the lanes), so a row's bits depend only on
// its own values and on whether its call had <= kInt16MaxRows rows.
//
// Those two are the activations="float32" paths. activations="int8" (int8.h)
// quantizes x to int8 per 32-block for any M: one arithmetic, bitwise the same
// for a row alone or in any call. activations="int8x2" adds a second int8 term,
// the residual x - dx * xq quantized the same way, and sums the two terms'
// outputs: ~15 bits of x per block, still one arithmetic for any M.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace paged::cpu::linear {

constexpr int64_t kBlock = 32;  // weights per quant block along K
// Bytes per 32-block of 5-bit codes packed per block (q8_packed.h): 16 of nibbles, 4 of fifth bits
constexpr int64_t kQ8PackedBlockBytes = 20;
constexpr int64_t kSerialMacs = int64_t(1) << 16;  // calls below this many multiply-adds stay on the calling thread
constexpr int kLanes = 8;       // fp32 accumulator lanes per output
constexpr int32_t kActMax = 32767;  // int16 activations lie in [-kActMax, kActMax]
constexpr float kLoScale = 1.f / 65536.f;  // s_lo = s * kLoScale (a power of two: exact)
// x's quantized block b of a row: kBlock hi codes, then kBlock lo codes.
constexpr int64_t kXBlock = 2 * kBlock;

// Calls with at most this many rows of x take the int16 path, more the fp32
// path (1 thread, whole model: M=2 int16 is faster, M=3 fp32; docs/kernels.md).
constexpr int64_t kInt16MaxRows = 2;
// Rows of x up to this many read the packed codes directly; more rows first
// widen a panel of weight rows' codes once (same arithmetic either way).
constexpr int64_t kDirectMaxRows = 4;
static_assert(kInt16MaxRows <= kDirectMaxRows, "the int16 kernels only have direct tiles");

// Q4_0 / Q4_1 / Q8_0: GGUF's own blocks (scales widened to float32); S16:
// int8 codes with a scale (and offset) per 16 weights (s16.h).
enum class QType { Q4_0, Q4_1, Q8_0, S16 };

// What the kernels multiply the weight codes by: x itself (the float32 paths
// above), its int8 quantization (int8.h), or two int8 terms (int8.h).
enum class Activations { Float32, Int8, Int8x2 };
// How persistent weight panels (weight_panels.h) keep a chunk's block
// scales: float32; fp16, when every d (and m) is an fp16 value (GGUF's
// own scales, widened at load: exact); or Compact, a signed byte per block
// and a float32 per 256 weights as compact scales hold them
// (compact_scales.h); CompactPairs (s16 only): Compact with one byte per
// 32 weights where each half's byte equals its pair's (Q5_K's scales, per
// 32 weights, held per 16 by s16). The kernels widen them in registers to
// the same float32 values, so the form changes bytes, never bits.
// CompactF16 / CompactPairsF16: the same with the supers as fp16, when
// every super is an fp16 value (GGUF's d and -dmin always are: 2 bytes per
// 256 weights and scale kind less, Q4_K's panel 152 -> 148 bytes per 256
// weights against the file's 144).
enum class PanelScales : int8_t { F32, F16, Compact, CompactPairs, CompactF16, CompactPairsF16 };
constexpr bool compact_form(PanelScales f) { return f >= PanelScales::Compact; }
constexpr bool pairs_form(PanelScales f) { return f == PanelScales::CompactPairs || f == PanelScales::CompactPairsF16; }
// bytes of one super value in a compact form's panel
constexpr int64_t super_bytes(PanelScales f) { return f >= PanelScales::CompactF16 ? 2 : 4; }
// "float32" / "int8" / "int8x2", else ValueError "activations: expected ..., got '<s>'".
Activations parse_activations(const std::string& s);

struct LinearArgs {
  QType qtype;
  int64_t M = 0, N = 0, K = 0;
  const float* x = nullptr;       // [M, K] (fp32 path)
  const int16_t* xq = nullptr;    // [M, 2K] int16 path: per block hi codes then lo codes
  const float* xscale = nullptr;  // [M, K/32, 2] int16 path: the scales (s, s_lo) of xq's blocks
  const uint8_t* qs = nullptr;    // [N, K/2] nibbles or [N, K] int8
  const float* d = nullptr;       // [N, K/32]
  const float* m = nullptr;       // [N, K/32] for Q4_1, else null
  // S16's codes: 8 = int8 [N, K] as they lie; 2 to 6 = packed into that
  // many bits per code with code_bias added (s16.h, "Packed codes"); Q8_0's:
  // 8, 5 (q8_packed.h: 20 bytes per 32-block) or 4 (q8_packed.h: indices
  // into IQ4_NL's table, 16 bytes per 32-block)
  int code_bits = 8;
  int code_bias = 0;
  // S16's 5-bit codes packed per 32-block as q8_0's (q8_packed.h; qtype
  // "s16.u5b" / "s16.s5b": rows whose K is not a multiple of 256), which
  // the s16 driver unpacks per work item for every build
  bool code_blocks = false;
  // Compact scales (compact_scales.h; q4_1, q8_0 and s16): d and m (m8 may be
  // null) in that form, and d / m above point at the call's widened copy
  // (null until the driver widens)
  const uint8_t* d8 = nullptr;
  const uint8_t* m8 = nullptr;
  // S16's scales as fp16 pairs (s16.h, "Half-pair scales"): d16 (and m16)
  // [N, K/32], each value the scale of both halves of its block; d / m
  // likewise point at the call's widened copy
  const uint16_t* d16 = nullptr;
  const uint16_t* m16 = nullptr;
  const float* xs = nullptr;      // [K/32, M] block sums of x, xs[b * M + r] (block-major:
                                  // a block's sums of consecutive rows are adjacent)
  // int8 path (int8.h), each [M, ...] row-major:
  const int8_t* x8 = nullptr;       // [M, K] codes xq
  const float* x8_scale = nullptr;  // [M, K/32] dx
  const int32_t* x8_corr = nullptr; // [M, K/32] -offset * sum of the block's codes
  const float* x8_sum = nullptr;    // [M, K/32] dx * sum of the block's codes (q4_1)
  // int8x2 (int8.h): the low codes and their corr; null for int8. Each
  // block's isum is then isum(x8) * 256 + isum(x8_lo), x8_scale the low scale.
  const int8_t* x8_lo = nullptr;      // [M, K]
  const int32_t* x8_lo_corr = nullptr; // [M, K/32]
  // int8x2's pair tiles (int8.h, Kernels::pair_tiles): each row's codes c =
  // 256 xq + lo as int16 in s16.h's pair order (pair_codes), or null.
  const int16_t* x16 = nullptr;       // [M, K]
  // The same per-block values block-major (int8.h, Int8BlockMajor), for the
  // builds that read one block of many rows at a time (Kernels::block_major).
  struct BlockMajor {
    const float* scale = nullptr;     // [nb][ld] x8_scale
    const float* sum = nullptr;       // [nb][ld] x8_sum
    const int32_t* corr = nullptr;    // [nb][ld] x8_corr, or int8x2's x8_corr * 256 + x8_lo_corr
    int64_t ld = 0;                   // block b of row r at b * ld + r
  } x8_bm;
  // The active build's persistent weight panels (weight_panels.h), checked
  // at the boundary, or null: the int8 kernels then build each chunk's panel;
  // and the form their scales are kept in (from the panels' header).
  const uint8_t* panels = nullptr;
  PanelScales panel_scales = PanelScales::F32;
  // whether the weight has offsets (m / m8) once panels stand for its
  // arrays (quant_linear nulls the weight's pointers then)
  bool panel_offsets = false;
  float* out = nullptr;           // [M, N]
  int64_t blocks() const { return K / kBlock; }
  bool has_offsets() const { return m || m8 || m16 || panel_offsets; }
  int64_t scales() const { return qtype == QType::S16 ? K / 16 : K / kBlock; }  // per row
  int64_t row_bytes() const {
    if (code_bits == 4 && qtype == QType::Q8_0) return K / 2;  // table indices (q8_packed.h)
    if (code_bits < 8 && (qtype == QType::Q8_0 || code_blocks)) return K / kBlock * kQ8PackedBlockBytes;
    if (qtype == QType::S16 && code_bits < 8) return K / 256 * 32 * code_bits;  // s16.h, "Packed codes"
    return qtype == QType::Q8_0 || qtype == QType::S16 ? K : K / 2;
  }
};

// Computes out[:, n0:n1]. `scratch` is the calling thread's buffer (grown as
// needed) for codes widened once and reused by many rows of x.
using RowsKernel = void (*)(const LinearArgs&, int64_t n0, int64_t n1, std::vector<float>& scratch);

// The int8 path's kernels: out[:, n0:n1] with the thread's panel scratch (int8.h).
struct Int8Panel;
using Int8Kernel = void (*)(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel);
// One row of x quantized for the int8 path (int8.h): codes [K], per block dx,
// corr, xs [K/32].
using Int8Quantize = void (*)(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr, float* xs);
// int8x2's low term of one row (int8.h) from its int8 quantization: low codes
// [K], and per block dx rewritten as the low scale, lo_corr, xs [K/32].
using Int8LowTerm = void (*)(const float* x, int64_t K, QType t, const int8_t* hi, int8_t* lo, float* dx,
                             int32_t* lo_corr, float* xs);

// The s16 layout's kernel (s16.h).
struct S16Args;
using S16Kernel = void (*)(const S16Args& s, int64_t n0, int64_t n1);
// The 16-bit float weight layouts' kernel (half.h).
struct HalfArgs;
using HalfKernel = void (*)(const HalfArgs& h, int64_t n0, int64_t n1);
// rows [n0, n1) of compact scales (`scales` per row over K weights) into float32 [N, scales]
using WidenCompact = void (*)(const uint8_t* c, int64_t scales, int64_t K, int64_t n0, int64_t n1, float* out);
// rows [n0, n1) of fp16 half-pair scales [N, nb] (s16.h) into float32 [N, 2 nb], each value twice
using WidenHalfPairs = void (*)(const uint16_t* h, int64_t nb, int64_t n0, int64_t n1, float* out);
// rows [0, rows) of s16 packed codes (s16.h) into int8 [rows, K]
using S16Unpack = void (*)(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out);
// rows [0, rows) of 5-bit codes packed per 32-block (q8_packed.h; u = q + bias) into int8 [rows, K]
using Block5Unpack = void (*)(const uint8_t* packed, int64_t K, int bias, int64_t rows, int8_t* out);
// rows [0, rows) of q8_0 codes held as IQ4_NL table indices (q8_packed.h) into int8 [rows, K]
using Table4Unpack = void (*)(const uint8_t* packed, int64_t K, int64_t rows, int8_t* out);

// The kernels of one ISA build.
struct Kernels {
  RowsKernel int16_rows;  // float32 activations, M <= kInt16MaxRows
  RowsKernel fp32_rows;   // float32 activations, any M
  Int8Kernel int8_rows;   // int8 activations, any M
  Int8Quantize x8_quantize;  // x for int8_rows
  Int8LowTerm x8_low_term;   // int8x2's second term for int8_rows
  bool block_major = false;  // int8_rows reads LinearArgs::x8_bm (else it may be left empty)
  // int8_rows multiplies the weight by LinearArgs::x16 (int8x2 calls of at
  // least pair_min_rows rows, int8.h) when it is given
  bool pair_tiles = false;
  // Persistent weight panels (weight_panels.h), for a build that has them:
  // the layout's name, the bytes of a chunk of kI8ChunkRows weight rows
  // (int8.h) with its scales in that form, and chunk [n0, n1)'s panel built
  // into dst (64-byte aligned), its scales in a.panel_scales' form.
  const char* panel_layout = nullptr;
  int64_t (*panel_chunk_bytes)(const LinearArgs& a, PanelScales scales) = nullptr;  // of a's qtype, K, code form
  void (*build_panel_chunk)(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst) = nullptr;
  // its inverse: rows [n0, n1) of the chunk at src back into a's qs, d / d8 and m / m8
  // (the weight's own arrays, bit for bit; any build of this layout may read it)
  void (*unpack_panel_chunk)(const LinearArgs& a, int64_t n0, int64_t n1, const uint8_t* src) = nullptr;
  // int8_rows widens compact scales itself (LinearArgs::d8 / m8): the driver leaves them compact
  bool int8_reads_compact_scales = false;
  // the s16 layout's int8 paths (null: the scalar definition, isa_scalar::s16_rows)
  S16Kernel s16_rows = nullptr;
  // the f16 / bf16 layouts (null: the scalar definition, isa_scalar::half_rows)
  HalfKernel half_rows = nullptr;
  // compact scales' widening (compact_scales.h; null: its plain loop)
  WidenCompact widen_compact = nullptr;
  // s16's fp16 half-pair scales' widening (compact_scales.h; null: its plain loop)
  WidenHalfPairs widen_half_pairs = nullptr;
  // s16's packed codes into int8 (s16.h; null: its plain loop, unpack_s16_rows)
  S16Unpack s16_unpack = nullptr;
  // 5-bit codes packed per 32-block (q8_0's, s16's "s16.u5b") into int8 (q8_packed.h; null: its plain loop, unpack_block5_rows)
  Block5Unpack block5_unpack = nullptr;
  // q8_0's IQ4_NL table indices into int8 (q8_packed.h; null: its plain loop, unpack_table4_rows)
  Table4Unpack table4_unpack = nullptr;
  // int8_rows reads q8_0's packed codes itself (q8_packed.h), in calls of any rows
  bool q8_reads_packed = false;
  // int8_rows reads q8_0's IQ4_NL table indices itself (q8_packed.h), in calls of any rows
  bool q8_reads_table = false;
  // s16_rows reads packed codes itself in calls of at most kS16FewRows rows
  bool s16_packed_few_rows = false;
  // s16_rows widens compact scales itself in calls of at most kS16FewRows rows
  bool s16_few_rows_reads_compact = false;
  // s16_rows runs one-term calls of more than kS16FewRows rows on bytes
  // (s16.h, kS16ByteBias): they get half_bias, and no c16
  bool s16_byte_tiles = false;
};

namespace isa_scalar {
void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
}  // namespace isa_scalar
namespace isa_avx2 {  // x86-64 (arch/x86/linear/kernel_i16_avx2.cpp, kernel_f32_avx2.cpp, widen_avx2.cpp)
void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
void widen_compact(const uint8_t* c, int64_t scales, int64_t K, int64_t n0, int64_t n1, float* out);
void widen_half_pairs(const uint16_t* h, int64_t nb, int64_t n0, int64_t n1, float* out);
}  // namespace isa_avx2
namespace isa_neon {  // aarch64 (arch/arm/linear/kernel_neon.cpp)
void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
void fp32_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch);
}  // namespace isa_neon

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

Kernels active_kernels();
const char* current_isa();
void set_isa(const std::string& name);
std::vector<std::string> supported_isas();

}  // namespace paged::cpu::linear
