// AVX-512 VNNI build of the int8 path (int8.h), bitwise equal to the scalar
// build: the same exact int32 block sums, then per output the same fp32 steps
// (one multiply d * dx, one fma per block, q4_1's fma with m), in vector lanes.
//
// Layout: the lanes of a zmm are 16 weight rows, so a block's sum for 16
// outputs is 8 vpdpbusd (4 codes per lane each) with x's 4 codes broadcast,
// and no horizontal sum is needed. The packed rows are turned into that
// layout by 16 x 16 dword transposes (64 bytes of 16 rows at a time, then
// and/shift for the nibbles, or + 128 for q8 codes); d (and m) likewise.
// A work item is 32 weight rows (kI8ChunkRows), 2 columns of 16, and:
//  - calls of <= kDirectRows rows feed the transposed codes straight from
//    registers to vpdpbusd (few rows are bound by streaming the weight,
//    where storing and reloading a panel costs more than it saves);
//  - more rows widen the item's codes once into the thread's panel,
//    [block][step of 4 codes][column][row][4] bytes, which register tiles of
//    R x rows x 32 weight rows then sweep (each weight vector serves R rows,
//    each x broadcast 2 columns): per block and 4-row tile 64 vpdpbusd (128
//    for int8x2), then per output vector a convert, a multiply and an fma
//    (two for q4_1). Those fp32 steps share the multiply pipes with
//    vpdpbusd, which bounds the tile below one vpdpbusd per cycle.
// While an item's rows are read, the same lines two items on (the thread's,
// under the static schedule) are prefetched into L2: at decode the weight
// streams from DRAM.
// Persistent panels (LinearArgs::panels, weight_panels.h) hold each item's
// panel built once by the same code (build_panel_chunk), so no call
// transposes: q8_0's as bytes, which the tiles read in place at every M
// (its panel is as large as its packed weight); 4-bit ones as the
// transposed nibble dwords (kNibbleBlockBytes a block: as many bytes as the
// packed codes), read in place by both paths in one sequential stream:
// calls of up to nibble_panel_rows() rows (int8.h) by nibble_columns, larger ones by tiles that
// split each nibble load into two steps' codes (an and and a shift, which
// run beside vpdpbusd on the other vector pipes). Half the bytes of a panel
// of one byte per code go through L1 and L2 (0.75 instead of 1.25 bytes per
// 4-bit weight). The AMX builds, whose tiles load bytes, get a 4-bit item
// widened once (widen_nibbles). A persistent panel keeps its scales in
// their most compact exact form (PanelScales: fp16, or compact bytes and
// supers), which panel_scale widens per block: at decode float32 scales
// were 0.5-1 bit more per weight streamed from DRAM.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "arch/target.h"
#include "arch/x86/linear/int8_avx512.h"
#include "attention/kernel_common.h"
#include "linear/aligned.h"
#include "linear/compact_scales.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"

// GCC 12 reports its own AVX-512 intrinsic headers (the deliberately undefined
// pass-through operand __Y) as (maybe-)uninitialized: GCC bug 105593.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#define PAGED_VNNI512_ISA "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
PAGED_TARGET_BEGIN(PAGED_VNNI512_ISA)
namespace paged::cpu::linear::isa_avx512 {
namespace {

// x rows per register tile: 6 one-term (int8) rows (a little faster than 4)
// and 4 two-term (int8x2) ones, whose tile holds twice the int32 sums
constexpr int kTileRows1 = 6, kTileRows2 = 4;
// Calls of up to this many rows skip the panel of codes (below it, building
// the panel costs more than it saves); with persistent 4-bit panels they
// take nibble_columns, faster there than tiles over widened codes.
constexpr int kDirectRows = 8;

// Transposes a 16 x 16 matrix of dwords held one row per register.
PAGED_ALWAYS_INLINE void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (r_i e0, r_i+1 e0, r_i e1, r_i+1 e1), ...
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // v[i + e], lane L: rows i .. i+3, element 4L + e
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // gather lane L of the four row groups
    const __m512i x0 = _mm512_shuffle_i32x4(v[e], v[4 + e], 0x88), x1 = _mm512_shuffle_i32x4(v[e], v[4 + e], 0xdd);
    const __m512i x2 = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0x88);
    const __m512i x3 = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0xdd);
    t[e] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    t[8 + e] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
    t[4 + e] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// Prefetches into L2 the line `ahead` bytes past p, computed as an integer:
// the address may lie past the weight (a prefetch never faults). Into L1 the
// prefetches held up the loads.
PAGED_ALWAYS_INLINE void prefetch_ahead(const void* p, int64_t ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + uintptr_t(ahead)), _MM_HINT_T1);
}

// Block b's share (1 / nb) of the `chunk` bytes at base, `ahead` bytes on:
// reading a chunk block by block prefetches the chunk after next likewise.
PAGED_ALWAYS_INLINE void prefetch_block_share(const uint8_t* base, int64_t chunk, int64_t nb, int64_t b,
                                              int64_t ahead) {
  const int64_t share = chunk / nb;
  for (int64_t at = b * share; at < (b + 1) * share; at += 64) prefetch_ahead(base + at, ahead);
}

// v[i] = the 64 bytes at `offset` of row i (stride bytes apart), `dwords` of
// them (the rest zero), for i < rows; zero beyond. Each line read is also
// prefetched kAhead rows further on: the same bytes of the thread's work item
// after next (static schedule: a thread's items are consecutive), which
// streams from DRAM at decode.
PAGED_ALWAYS_INLINE void load_rows(const uint8_t* base, int64_t stride, int rows, int64_t offset, int64_t dwords,
                                   __m512i v[16]) {
  const auto mask = __mmask16(dwords >= 16 ? 0xFFFF : (1u << dwords) - 1);
  const uint8_t* p = base + offset;
  for (int i = 0; i < 16; ++i, p += stride) {
    prefetch_ahead(p, kAhead * stride);
    v[i] = _mm512_maskz_loadu_epi32(i < rows ? mask : 0, p);
  }
}

// Rows n0 .. n0 + rows of a [N, nb] float matrix (d or m) transposed into
// column c of dst [nb][kPanel]: 16 blocks per transpose, the last nb % 16 by
// scalar copies (a transpose costs as much for 2 blocks as for 16).
void transpose_scales(const float* src, int64_t nb, int64_t n0, int rows, int c, float* dst) {
  __m512i v[16];
  int64_t b = 0;
  for (; b + 16 <= nb; b += 16) {
    load_rows(reinterpret_cast<const uint8_t*>(src + n0 * nb), nb * 4, rows, b * 4, 16, v);
    transpose16(v);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + (b + i) * kPanel + c * kLanes, v[i]);
  }
  for (; b < nb; ++b)
    for (int i = 0; i < kLanes; ++i) dst[b * kPanel + c * kLanes + i] = i < rows ? src[(n0 + i) * nb + b] : 0.f;
  if (nb < 16)  // else their lines were prefetched with the transposed blocks'
    for (int i = 0; i < rows; ++i) prefetch_ahead(src + (n0 + i) * nb, kAhead * nb * 4);
}

// A block's nibble dword s of 16 rows (4-bit codes): its low nibbles are
// the byte panel's step s (codes 4s .. 4s+3), its high nibbles step 4 + s
// (codes 16 + 4s ..).
PAGED_ALWAYS_INLINE void nibble_steps(__m512i v, __m512i& lo_step, __m512i& hi_step) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  lo_step = _mm512_and_si512(v, low);
  hi_step = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

// q8_0's IQ4_NL table indices (q8_packed.h) as nibble_steps makes them into
// the byte panel's u = value + 128: one vpshufb per step (the table in every
// 128-bit lane).
PAGED_ALWAYS_INLINE __m512i table_lut() {
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
  return _mm512_xor_si512(_mm512_broadcast_i32x4(values), _mm512_set1_epi8(char(0x80)));
}
// A block's nibble dword s as nibble_steps does, looked up where `table`.
PAGED_ALWAYS_INLINE void code_steps(__m512i v, bool table, __m512i lut, __m512i& lo_step, __m512i& hi_step) {
  nibble_steps(v, lo_step, hi_step);
  if (table) {
    lo_step = _mm512_shuffle_epi8(lut, lo_step);
    hi_step = _mm512_shuffle_epi8(lut, hi_step);
  }
}

// Step t's unsigned codes u = q + 16 of q8_0's 5-bit packed codes
// (q8_packed.h): its 4 low bits (`low`, as nibble_steps makes them) with
// bit t of each byte of the block's fifth-bit dword moved to bit 4: a shift
// and one ternary-logic op (low | (shifted & 0x10)).
PAGED_ALWAYS_INLINE __m512i packed_q8_step(__m512i low, __m512i fifth, int t) {
  const __m512i shifted = t <= 4 ? _mm512_slli_epi32(fifth, unsigned(4 - t)) : _mm512_srli_epi32(fifth, unsigned(t - 4));
  return _mm512_ternarylogic_epi32(low, shifted, _mm512_set1_epi8(0x10), 0xF8);
}

// The 8 steps' u of a block from its transposed dwords v[0 .. 4] (4 nibble
// dwords, then the fifth bits): w[2s + h] = step 4h + s (direct_block's order).
PAGED_ALWAYS_INLINE void packed_q8_steps(const __m512i v[5], __m512i w[8]) {
  for (int s = 0; s < 4; ++s) {
    nibble_steps(v[s], w[2 * s], w[2 * s + 1]);
    for (int h = 0; h < 2; ++h) w[2 * s + h] = packed_q8_step(w[2 * s + h], v[4], 4 * h + s);
  }
}

// Packed q8_0 rows' blocks per 16 x 16 dword transpose (15 of its dwords).
constexpr int64_t kPackedQ8Blocks = 3;
static_assert(kPackedQ8Dwords * 4 == kQ8PackedBlockBytes, "a packed block is 5 dwords");

// Packed q8_0 rows n0 .. n0 + rows (q8_packed.h) block by block:
// `block(b, v)` with v block b's 5 dwords of the 16 rows, transposed (3
// blocks per 16 x 16 transpose).
template <class Block>
PAGED_ALWAYS_INLINE void packed_q8_blocks(const LinearArgs& a, int64_t n0, int rows, Block block) {
  const int64_t nb = a.blocks(), row_bytes = a.row_bytes();
  __m512i v[16];
  for (int64_t b0 = 0; b0 < nb; b0 += kPackedQ8Blocks) {
    const int64_t blocks = std::min(kPackedQ8Blocks, nb - b0);
    load_rows(a.qs + n0 * row_bytes, row_bytes, rows, b0 * kQ8PackedBlockBytes, blocks * kPackedQ8Dwords, v);
    transpose16(v);
    for (int64_t i = 0; i < blocks; ++i) block(b0 + i, v + kPackedQ8Dwords * i);
  }
}

// Column c of packed q8_0 codes' panel: bytes q + 128 = u + 112, or a
// persistent panel's transposed dwords as they are (p.packed_q8).
void build_packed_q8_column(const LinearArgs& a, int64_t n0, int rows, int c, const PanelView& p) {
  const __m512i bias = _mm512_set1_epi8(0x70);
  packed_q8_blocks(a, n0, rows, [&](int64_t b, const __m512i* v) PAGED_ALWAYS_INLINE_LAMBDA {
    if (p.packed_q8) {
      for (int s = 0; s < kPackedQ8Dwords; ++s) _mm512_store_si512(p.packed_q8 + packed_q8_offset(b, s, c), v[s]);
      return;
    }
    __m512i w[8];
    packed_q8_steps(v, w);
    uint8_t* dst = p.codes + b * kBlockBytes + c * 64;
    for (int s = 0; s < 4; ++s)
      for (int h = 0; h < 2; ++h) _mm512_store_si512(dst + (4 * h + s) * kCols * 64, _mm512_add_epi8(w[2 * s + h], bias));
  });
}

// Column c (rows n0 .. n0 + rows) of the panel's unsigned codes: bytes in
// p.codes, or for 4-bit codes with p.nibbles (persistent panels) the
// transposed nibble dwords as they are (kNibbleBlockBytes per block).

template <QType T>
void build_column(const LinearArgs& a, int64_t n0, int rows, int c, const PanelView& p) {
  if (T == QType::Q8_0 && q8_packed(a)) return build_packed_q8_column(a, n0, rows, c, p);
  const int64_t nb = a.blocks(), row_bytes = a.row_bytes();
  const bool table = T == QType::Q8_0 && q8_table(a), bytes = T == QType::Q8_0 && !table;  // else nibbles
  const int64_t blocks_per_chunk = bytes ? 2 : 4;  // 64 bytes of packed codes
  const __m512i bias = _mm512_set1_epi8(char(0x80)), lut = table_lut();
  __m512i v[16];
  for (int64_t chunk = 0; chunk * 64 < row_bytes; ++chunk) {
    load_rows(a.qs + n0 * row_bytes, row_bytes, rows, chunk * 64, std::min<int64_t>(16, (row_bytes - chunk * 64) / 4),
              v);
    transpose16(v);  // v[j]: dword j of the chunk, 16 rows
    for (int64_t i = 0; i < blocks_per_chunk && chunk * blocks_per_chunk + i < nb; ++i) {
      const int64_t b = chunk * blocks_per_chunk + i;
      if (bytes) {
        uint8_t* dst = p.codes + b * kBlockBytes + c * 64;
        for (int s = 0; s < kSteps; ++s) _mm512_store_si512(dst + s * kCols * 64, _mm512_xor_si512(v[8 * i + s], bias));
      } else if (p.nibbles) {
        for (int s = 0; s < 4; ++s) _mm512_store_si512(p.nibbles + nibble_offset(b, s, c), v[4 * i + s]);
      } else {
        uint8_t* dst = p.codes + b * kBlockBytes + c * 64;
        for (int s = 0; s < 4; ++s) {
          __m512i lo, hi;
          code_steps(v[4 * i + s], table, lut, lo, hi);
          _mm512_store_si512(dst + s * kCols * 64, lo);
          _mm512_store_si512(dst + (4 + s) * kCols * 64, hi);
        }
      }
    }
  }
}

// Rows n0 .. n0 + rows of compact scales (compact_scales.h: a byte per
// block, then a float32 per 256 weights) into column c of dst [nb][kPanel],
// widened and transposed in one pass: per 16 blocks the rows' bytes as
// dwords, transposed, then each block's 16 codes converted and multiplied
// by their super-blocks' floats (gathered once per 8 blocks):
// fl(super * float(byte)), the widened floats bit for bit, without writing
// and re-reading them (at decode that was a fifth of a Q4_K token).
void transpose_compact_scales(const uint8_t* c8, int64_t K, int64_t n0, int rows, int c, float* dst) {
  const int64_t nb = K / kBlock, row_bytes = compact_row_bytes(nb, K);
  const uint8_t* base = c8 + n0 * row_bytes;
  const auto live = __mmask16((1u << rows) - 1);
  const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int32_t(row_bytes)));
  for (int i = 0; i < rows; ++i)  // the thread's item after next, as load_rows prefetches
    for (int64_t at = 0; at < row_bytes; at += 64) prefetch_ahead(base + i * row_bytes + at, kAhead * row_bytes);
  __m512 super = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, nb - b0);
    const auto in_row = __mmask16((1u << count) - 1);
    __m512i v[16];
    for (int i = 0; i < 16; ++i)
      v[i] = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(i < rows ? in_row : 0, base + i * row_bytes + b0));
    transpose16(v);  // v[j]: block b0 + j's codes of the 16 rows
    for (int64_t j = 0; j < count; ++j) {
      const int64_t b = b0 + j;
      if (b % kBlocksPerSuper == 0)
        super = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live,
                                         _mm512_add_epi32(row_at, _mm512_set1_epi32(int32_t(nb + 4 * (b / kBlocksPerSuper)))),
                                         base, 1);
      _mm512_store_ps(dst + b * kPanel + c * kLanes, _mm512_mul_ps(super, _mm512_cvtepi32_ps(v[j])));
    }
  }
}

// Column c (rows n0 .. n0 + rows) of the panel's scales: float32 d (and
// q4_1's m) transposed, or compact ones widened on the way (Q4_K's q4_1,
// always with compact m: checked at the boundary; IQ4_XS's q8_0).
template <QType T>
void build_scales(const LinearArgs& a, int64_t n0, int rows, int c, const PanelView& p) {
  if (a.d8) {
    transpose_compact_scales(a.d8, a.K, n0, rows, c, p.d);
    if constexpr (T == QType::Q4_1) transpose_compact_scales(a.m8, a.K, n0, rows, c, p.m);
    return;
  }
  transpose_scales(a.d, a.blocks(), n0, rows, c, p.d);
  if constexpr (T == QType::Q4_1) transpose_scales(a.m, a.blocks(), n0, rows, c, p.m);
}

// One block of 16 outputs: acc = fma(d * dx, float(isum), acc), then q4_1's
// acc = fma(m, xs, acc); d and m: the block's 16 panel lanes (panel_scale).
template <QType T>
PAGED_ALWAYS_INLINE __m512 block_step(__m512 acc, __m512i isum, __m512 d, __m512 m, float dx, float xs) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum), acc);
  if constexpr (T == QType::Q4_1) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(xs), acc);
  return acc;
}

// Block b's d and q4_1's m of column c (m unset for the other types).
template <QType T>
PAGED_ALWAYS_INLINE void block_scales(const PanelView& p, int64_t b, int c, __m512& d, __m512& m) {
  d = panel_scale(p, false, b, c);
  m = T == QType::Q4_1 ? panel_scale(p, true, b, c) : _mm512_setzero_ps();
}

// A row's int32 start for block b: corr (0 for q4_1, whose codes need no offset).
template <QType T>
PAGED_ALWAYS_INLINE __m512i corr_start(const int32_t* corr, int64_t row, int64_t nb, int64_t b) {
  return T == QType::Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(corr[row * nb + b]);
}

// The two-term sum hi * 256 + lo (int8.h), exact in int32.
PAGED_ALWAYS_INLINE __m512i fold(__m512i hi, __m512i lo) { return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo); }

// isum[r][c] = block b's exact sums of x rows r0 .. r0+R with the panel's
// columns, whose block starts at w (int8.h: from corr; int8x2 (Two) folds the
// low codes' sums in). Both terms run in one pass over the block's 8 steps,
// each weight vector loaded once for both: 2 weight vectors live instead of
// the block's 16, which with the accumulators had spilled the fp32 sums to
// the stack; the sums are the same integers in any order.
template <QType T, int R, bool Two, bool Nib>
PAGED_ALWAYS_INLINE void tile_sums(const uint8_t* w, const LinearArgs& a, int64_t r0, int64_t b,
                                   __m512i isum[R][kCols]) {
  constexpr int kTerms = Two ? 2 : 1;
  constexpr int S = kTerms * R * kCols >= 8 ? 1 : 2;  // int32 chains per output: >= 8 vpdpbusd in flight
  const int64_t K = a.K, nb = a.blocks();
  __m512i dot[kTerms][S][R][kCols];
  for (int t = 0; t < kTerms; ++t)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) {
        dot[t][0][r][c] = corr_start<T>(t ? a.x8_lo_corr : a.x8_corr, r0 + r, nb, b);
        if constexpr (S == 2) dot[t][1][r][c] = _mm512_setzero_si512();
      }
  // step s's sums with its weight codes wv (x codes 4s .. 4s+3)
  const auto step = [&](int s, const __m512i wv[kCols]) PAGED_ALWAYS_INLINE_LAMBDA {
    for (int t = 0; t < kTerms; ++t) {
      const int8_t* x = t ? a.x8_lo : a.x8;
      for (int r = 0; r < R; ++r) {
        const __m512i xb = broadcast4(x + (r0 + r) * K + b * kBlock + 4 * s);
        for (int c = 0; c < kCols; ++c) dot[t][s % S][r][c] = _mm512_dpbusd_epi32(dot[t][s % S][r][c], wv[c], xb);
      }
    }
  };
  if constexpr (Nib) {  // w: the block's nibble dwords; steps s and 4 + s from one load
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512i lo[kCols], hi[kCols];
      for (int c = 0; c < kCols; ++c) nibble_steps(_mm512_load_si512(w + nibble_offset(0, s, c)), lo[c], hi[c]);
      step(s, lo);
      step(4 + s, hi);
    }
  } else {
#pragma GCC unroll 8
    for (int s = 0; s < kSteps; ++s) {
      __m512i wv[kCols];
      for (int c = 0; c < kCols; ++c) wv[c] = _mm512_load_si512(w + (s * kCols + c) * 64);
      step(s, wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) {
      __m512i sum[kTerms];
      for (int t = 0; t < kTerms; ++t)
        sum[t] = S == 2 ? _mm512_add_epi32(dot[t][0][r][c], dot[t][S - 1][r][c]) : dot[t][0][r][c];
      isum[r][c] = Two ? fold(sum[0], sum[kTerms - 1]) : sum[0];
    }
}

// out[r0 .. r0+R, n0 .. n0+32] (lanes outside `mask` not stored) from the
// panel: its byte codes, or (Nib) a persistent 4-bit panel's nibbles.
template <QType T, int R, bool Two, bool Nib>
void tile(const LinearArgs& a, const PanelView& p, int64_t r0, int64_t n0, const __mmask16 mask[kCols]) {
  const int64_t nb = a.blocks();
  const uint8_t* base = Nib ? p.nibbles : p.codes;
  __m512 acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = base + b * (Nib ? kNibbleBlockBytes : kBlockBytes);
    if (p.ahead && r0 == 0) prefetch_block_share(base, p.ahead / (kAhead / kPanel), nb, b, p.ahead);
    __m512i isum[R][kCols];
    tile_sums<T, R, Two, Nib>(w, a, r0, b, isum);
    __m512 d[kCols], m[kCols];
    for (int c = 0; c < kCols; ++c) block_scales<T>(p, b, c, d[c], m[c]);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) {
        const int64_t xb = (r0 + r) * nb + b;
        acc[r][c] = block_step<T>(acc[r][c], isum[r][c], d[c], m[c], a.x8_scale[xb], a.x8_sum[xb]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) _mm512_mask_storeu_ps(a.out + (r0 + r) * a.N + n0 + c * kLanes, mask[c], acc[r][c]);
}

// One block b of column c for few rows of x (R): the block's sums of the R
// rows of codes x with its 8 steps of weight codes w (steps s and 4 + s at
// w[2s], w[2s + 1]; two chains, steps 0-3 and 4-7), then acc's fp32 step.
// CorrShift: the sums start at corr >> CorrShift (packed q8_0's u = q + 16).
template <QType T, int R, int CorrShift = 0>
PAGED_ALWAYS_INLINE void direct_block(const LinearArgs& a, const PanelView& p, int64_t b, int c, const __m512i w[8],
                                      __m512 acc[R]) {
  const int64_t nb = a.blocks(), K = a.K;
  const auto sums = [&](const int8_t* x, const int32_t* corr, __m512i isum[R]) PAGED_ALWAYS_INLINE_LAMBDA {
    __m512i dot[2][R];
    for (int r = 0; r < R; ++r) {
      dot[0][r] = T == QType::Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(corr[r * nb + b] >> CorrShift);
      dot[1][r] = _mm512_setzero_si512();
    }
    for (int s = 0; s < 4; ++s)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          dot[h][r] = _mm512_dpbusd_epi32(dot[h][r], w[2 * s + h], broadcast4(x + r * K + b * kBlock + 16 * h + 4 * s));
    for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(dot[0][r], dot[1][r]);
  };
  __m512i isum[R];
  sums(a.x8, a.x8_corr, isum);
  if (a.x8_lo) {  // int8x2: the low codes' sums folded in
    __m512i lo[R];
    sums(a.x8_lo, a.x8_lo_corr, lo);
    for (int r = 0; r < R; ++r) isum[r] = fold(isum[r], lo[r]);
  }
  __m512 d, m;
  block_scales<T>(p, b, c, d, m);
  for (int r = 0; r < R; ++r) acc[r] = block_step<T>(acc[r], isum[r], d, m, a.x8_scale[r * nb + b], a.x8_sum[r * nb + b]);
}

// Few rows of x (M = R <= kDirectRows) without persistent panels: out[0 ..
// R, n0 .. n0 + 16] of column c (rows valid under `mask`), its packed codes
// transposed and multiplied straight from registers; only its scales come
// from the panel.
// q8_0's IQ4_NL table indices (q8_packed.h) are nibbles as the 4-bit types'
// (4 blocks per 64 bytes), each step's u = value + 128 looked up (vpshufb).
template <QType T, int R>
void direct_column(const LinearArgs& a, const PanelView& p, int64_t n0, int c, __mmask16 mask) {
  const int64_t nb = a.blocks(), row_bytes = a.row_bytes();
  const bool table = T == QType::Q8_0 && q8_table(a);
  const int64_t chunk_blocks = T == QType::Q8_0 && !table ? 2 : 4;  // blocks per 64 bytes of packed codes
  const __m512i bias = _mm512_set1_epi8(char(0x80)), lut = table_lut();
  const int rows = __builtin_popcount(mask);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i v[16];
  for (int64_t chunk = 0; chunk * 64 < row_bytes; ++chunk) {
    load_rows(a.qs + n0 * row_bytes, row_bytes, rows, chunk * 64, std::min<int64_t>(16, (row_bytes - chunk * 64) / 4),
              v);
    transpose16(v);
    for (int64_t i = 0; i < chunk_blocks && chunk * chunk_blocks + i < nb; ++i) {
      __m512i w[8];
      for (int s = 0; s < 4; ++s) {
        if (table) {
          code_steps(v[4 * i + s], true, lut, w[2 * s], w[2 * s + 1]);
        } else if constexpr (T == QType::Q8_0) {
          w[2 * s] = _mm512_xor_si512(v[8 * i + s], bias);
          w[2 * s + 1] = _mm512_xor_si512(v[8 * i + 4 + s], bias);
        } else {
          nibble_steps(v[4 * i + s], w[2 * s], w[2 * s + 1]);
        }
      }
      direct_block<T, R>(a, p, chunk * chunk_blocks + i, c, w, acc);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + r * a.N + n0, mask, acc[r]);
}

// Both columns of a persistent panel (rows under mask[c]) at once: block by
// block, the chunk's bytes in order (one sequential stream, as the hardware
// prefetchers like it), `steps(b, c, w)` widening block b of column c in
// registers to direct_block's 8 steps. While a block is read, the chunk's
// lines `p.ahead` bytes on are prefetched, its share of them per block.
template <QType T, int R, int CorrShift, class Steps>
PAGED_ALWAYS_INLINE void panel_columns(const LinearArgs& a, const PanelView& p, const uint8_t* base, int64_t n0,
                                       const __mmask16 mask[kCols], Steps steps) {
  const int64_t nb = a.blocks(), chunk = p.ahead / (kAhead / kPanel);
  __m512 acc[kCols][R];
  for (int c = 0; c < kCols; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_block_share(base, chunk, nb, b, p.ahead);
    for (int c = 0; c < kCols; ++c) {
      __m512i w[8];
      steps(b, c, w);
      direct_block<T, R, CorrShift>(a, p, b, c, w, acc[c]);
    }
  }
  for (int c = 0; c < kCols; ++c)
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + r * a.N + n0 + c * kLanes, mask[c], acc[c][r]);
}

// A persistent 4-bit panel: each block's codes are 4 nibble vectors a column.
template <QType T, int R>
void nibble_columns(const LinearArgs& a, const PanelView& p, int64_t n0, const __mmask16 mask[kCols]) {
  const __m512i lut = table_lut();
  panel_columns<T, R, 0>(a, p, p.nibbles, n0, mask, [&](int64_t b, int c, __m512i w[8]) PAGED_ALWAYS_INLINE_LAMBDA {
    for (int s = 0; s < 4; ++s)
      code_steps(_mm512_load_si512(p.nibbles + nibble_offset(b, s, c)), p.table, lut, w[2 * s], w[2 * s + 1]);
  });
}

// Few rows of x (M = R <= kDirectRows) on q8_0's 5-bit packed codes, read in
// place: 3 blocks of 16 rows per transpose, each block's codes widened in
// registers to u = q + 16 and multiplied as direct_column does, from the
// sums' start corr / 8 (corr = -128 * sum xq for q + 128: here -16 * sum
// xq, exact). The same int32 sums and steps as the byte form's; the weight
// streams 20 bytes a block instead of 32.
template <int R>
void packed_q8_column(const LinearArgs& a, const PanelView& p, int64_t n0, int c, __mmask16 mask) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  packed_q8_blocks(a, n0, __builtin_popcount(mask), [&](int64_t b, const __m512i* v) PAGED_ALWAYS_INLINE_LAMBDA {
    __m512i w[8];
    packed_q8_steps(v, w);
    direct_block<QType::Q8_0, R, 3>(a, p, b, c, w, acc);
  });
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + r * a.N + n0, mask, acc[r]);
}

// A persistent packed q8_0 panel (5 dwords a block and column), from the
// sums' start corr / 8 as packed_q8_column.
template <int R>
void packed_q8_panel_columns(const LinearArgs& a, const PanelView& p, int64_t n0, const __mmask16 mask[kCols]) {
  panel_columns<QType::Q8_0, R, 3>(a, p, p.packed_q8, n0, mask, [&](int64_t b, int c, __m512i w[8])
                                                                     PAGED_ALWAYS_INLINE_LAMBDA {
    __m512i v[kPackedQ8Dwords];
    for (int s = 0; s < kPackedQ8Dwords; ++s) v[s] = _mm512_load_si512(p.packed_q8 + packed_q8_offset(b, s, c));
    packed_q8_steps(v, w);
  });
}

// A persistent packed q8_0 chunk widened to the byte panel's codes (q + 128)
// for the tiles, a block's share of the chunk after next prefetched per block.
void widen_packed_q8(const PanelView& p, int64_t nb, int64_t chunk, uint8_t* codes) {
  const __m512i bias = _mm512_set1_epi8(0x70);
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_block_share(p.packed_q8, chunk, nb, b, p.ahead);
    for (int c = 0; c < kCols; ++c) {
      __m512i v[kPackedQ8Dwords], w[8];
      for (int s = 0; s < kPackedQ8Dwords; ++s) v[s] = _mm512_load_si512(p.packed_q8 + packed_q8_offset(b, s, c));
      packed_q8_steps(v, w);
      for (int s = 0; s < 4; ++s)
        for (int h = 0; h < 2; ++h)
          _mm512_store_si512(codes + b * kBlockBytes + ((4 * h + s) * kCols + c) * 64, _mm512_add_epi8(w[2 * s + h], bias));
    }
  }
}

using NibbleFn = void (*)(const LinearArgs&, const PanelView&, int64_t n0, const __mmask16 mask[kCols]);
template <int... R>
constexpr std::array<NibbleFn, sizeof...(R)> packed_panel_table(std::integer_sequence<int, R...>) {
  return {&packed_q8_panel_columns<R + 1>...};
}

using DirectFn = void (*)(const LinearArgs&, const PanelView&, int64_t n0, int c, __mmask16 mask);
template <int... R>
constexpr std::array<DirectFn, sizeof...(R)> packed_q8_table(std::integer_sequence<int, R...>) {
  return {&packed_q8_column<R + 1>...};
}
template <QType T, int... R>
constexpr std::array<DirectFn, sizeof...(R)> direct_table(std::integer_sequence<int, R...>) {
  return {&direct_column<T, R + 1>...};
}
template <QType T, int... R>
constexpr std::array<NibbleFn, sizeof...(R)> nibble_table(std::integer_sequence<int, R...>) {
  return {&nibble_columns<T, R + 1>...};
}

using TileFn = void (*)(const LinearArgs&, const PanelView&, int64_t r0, int64_t n0, const __mmask16 mask[kCols]);
template <QType T, bool Two, bool Nib, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&tile<T, R + 1, Two, Nib>...};
}

// Baseline code, outside the target region (as before the regions: kept
// where it was, so the kernels compile to the same instructions): the
// column masks and a persistent panel's view here, its chunk size and
// chunk_panel below; weight_panels.cpp and the AMX builds reach them too.
PAGED_TARGET_END()

// A chunk's persistent panel (weight_panels.cpp): its codes (q8_0's bytes,
// or 4-bit nibbles), then its scales in the panels' form: d, then q4_1's m
// (Compact: their bytes, then their supers).
// (q8_0's 5-bit packed codes kept as their transposed dwords, its IQ4_NL
// table indices as nibbles), all as a's type, code form and panel scales say.
PanelView chunk_view(const uint8_t* chunk, const LinearArgs& a) {
  const QType t = a.qtype;
  const int64_t nb = a.blocks();
  const PanelScales form = a.panel_scales;
  const bool packed = q8_packed(a), table = q8_table(a);
  auto* base = const_cast<uint8_t*>(chunk);
  const bool nibbles = t != QType::Q8_0 || table, q4_1 = t == QType::Q4_1;
  uint8_t* scales = base + nb * (packed ? kPackedQ8BlockBytes : nibbles ? kNibbleBlockBytes : kBlockBytes);
  PanelView p{nibbles || packed ? nullptr : base, nullptr, nullptr};
  p.nibbles = nibbles ? base : nullptr;
  p.packed_q8 = packed ? base : nullptr;
  p.table = table;
  p.scales = form;
  const int64_t values = nb * kPanel;  // of d, and of m
  switch (form) {
    case PanelScales::F32:
      p.d = reinterpret_cast<float*>(scales);
      p.m = q4_1 ? p.d + values : nullptr;
      break;
    case PanelScales::F16:
      p.d16 = reinterpret_cast<const uint16_t*>(scales);
      p.m16 = q4_1 ? p.d16 + values : nullptr;
      break;
    case PanelScales::Compact:
    case PanelScales::CompactF16:
    case PanelScales::CompactPairs:  // (the pairs forms: s16 only, never a q4 / q8 panel's)
    case PanelScales::CompactPairsF16:
      p.d8 = reinterpret_cast<const int8_t*>(scales);
      p.m8 = q4_1 ? p.d8 + values : nullptr;
      p.d_super = scales + (q4_1 ? 2 : 1) * values;
      p.m_super = q4_1 ? p.d_super + values / kBlocksPerSuper * super_bytes(form) : nullptr;
      break;
  }
  return p;
}

// Masks of the chunk's two columns (rows n0 .. n1).
void column_masks(int64_t n0, int64_t n1, __mmask16 mask[kCols]) {
  for (int c = 0; c < kCols; ++c)
    mask[c] = __mmask16((1u << int(std::clamp<int64_t>(n1 - n0 - c * kLanes, 0, kLanes))) - 1);
}

PAGED_TARGET_BEGIN(PAGED_VNNI512_ISA)

// The chunk's panel: scales always, codes unless `scales_only`.
template <QType T>
void build(const LinearArgs& a, int64_t n0, const __mmask16 mask[kCols], bool scales_only,
           const PanelView& p) {
  for (int c = 0; c < kCols; ++c) build_scales<T>(a, n0 + c * kLanes, __builtin_popcount(mask[c]), c, p);
  if (!scales_only)
    for (int c = 0; c < kCols; ++c) build_column<T>(a, n0 + c * kLanes, __builtin_popcount(mask[c]), c, p);
}

template <QType T>
void tiles(const LinearArgs& a, const PanelView& p, int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
  static constexpr auto one = tile_table<T, false, false>(std::make_integer_sequence<int, kTileRows1>());
  static constexpr auto two = tile_table<T, true, false>(std::make_integer_sequence<int, kTileRows2>());
  static constexpr auto one_nib = tile_table<T, false, T != QType::Q8_0>(std::make_integer_sequence<int, kTileRows1>());
  static constexpr auto two_nib = tile_table<T, true, T != QType::Q8_0>(std::make_integer_sequence<int, kTileRows2>());
  __mmask16 mask[kCols];
  column_masks(n0, n1, mask);
  const bool nib = p.codes == nullptr;  // a persistent 4-bit panel, read as nibbles
  const TileFn* table = a.x8_lo ? (nib ? two_nib : two).data() : (nib ? one_nib : one).data();
  const int64_t step = a.x8_lo ? kTileRows2 : kTileRows1;
  for (; r0 < r1; r0 += step) table[size_t(std::min<int64_t>(step, r1 - r0) - 1)](a, p, r0, n0, mask);
}

// A persistent 4-bit chunk's nibbles widened to the byte panel's codes
// (codes, kBlockBytes per block), prefetching the whole chunk `p.ahead`
// bytes on (its nibbles and scales; `chunk` bytes), a block's share at a time.
void widen_nibbles(const PanelView& p, int64_t nb, int64_t chunk, uint8_t* codes) {
  const __m512i lut = table_lut();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_block_share(p.nibbles, chunk, nb, b, p.ahead);
    uint8_t* dst = codes + b * kBlockBytes;
    for (int s = 0; s < 4; ++s)
      for (int c = 0; c < kCols; ++c) {
        __m512i lo, hi;
        code_steps(_mm512_load_si512(p.nibbles + nibble_offset(b, s, c)), p.table, lut, lo, hi);
        _mm512_store_si512(dst + (s * kCols + c) * 64, lo);
        _mm512_store_si512(dst + ((4 + s) * kCols + c) * 64, hi);
      }
  }
}

// Without persistent panels: chunk [n0, n1)'s 4-bit panel built per call in
// the persistent layout (nibbles: half the stores, and the tiles read half
// the bytes) instead of as bytes.
template <QType T>
PanelView scratch_nibble_panel(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& scratch) {
  const int64_t nb = a.blocks();
  scratch.d.resize(size_t(nb * kPanel));
  if (T == QType::Q4_1) scratch.m.resize(size_t(nb * kPanel));
  scratch.codes.resize(size_t(nb * kNibbleBlockBytes));
  PanelView p{nullptr, scratch.d.data(), scratch.m.data()};
  p.nibbles = scratch.codes.data();
  __mmask16 mask[kCols];
  column_masks(n0, n1, mask);
  build<T>(a, n0, mask, false, p);
  return p;
}

// A persistent panel's fp16 or compact scales widened once into the
// thread's scratch as float32, for the tiles: they read each block's scales
// once per tile of x rows, and the widening (compact's multiply) would repeat
// with every tile.
PanelView float_scales(PanelView p, QType t, int64_t nb, Int8Panel& scratch) {
  if (p.scales == PanelScales::F32) return p;
  const bool q4_1 = t == QType::Q4_1;
  scratch.d.resize(size_t(nb * kPanel));
  if (q4_1) scratch.m.resize(size_t(nb * kPanel));
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < kCols; ++c) {
      _mm512_store_ps(scratch.d.data() + b * kPanel + c * kLanes, panel_scale(p, false, b, c));
      if (q4_1) _mm512_store_ps(scratch.m.data() + b * kPanel + c * kLanes, panel_scale(p, true, b, c));
    }
  p.d = scratch.d.data();
  p.m = q4_1 ? scratch.m.data() : nullptr;
  p.scales = PanelScales::F32;
  return p;
}

// x rows per nibble_columns pass: both columns' sums and chains for more
// rows spill (Zen 4, q4_1 at 1B shapes, against the calls without persistent
// panels: 4 rows 0.89x (int8) / 0.95x (int8x2) in one pass, 1.12x / 1.25x in
// passes of 2; 8 rows 0.73x / 0.77x -> 0.98x / 1.07x).
constexpr int64_t kNibbleRows = 2;

// a's x rows [r0, r0 + count) as a call of their own (same weight and panels).
LinearArgs x_rows(LinearArgs a, int64_t r0, int64_t count) {
  const int64_t nb = a.blocks();
  a.M = count;
  a.x8 += r0 * a.K;
  if (a.x8_lo) a.x8_lo += r0 * a.K;
  a.x8_scale += r0 * nb;
  if (a.x8_corr) a.x8_corr += r0 * nb;
  if (a.x8_lo_corr) a.x8_lo_corr += r0 * nb;
  if (a.x8_sum) a.x8_sum += r0 * nb;
  a.out += r0 * a.N;
  return a;
}

template <QType T>
void rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& scratch) {
  static constexpr auto direct = direct_table<T>(std::make_integer_sequence<int, kDirectRows>());
  static constexpr auto nibble = nibble_table<T>(std::make_integer_sequence<int, kDirectRows>());
  // Without persistent panels, calls of few rows multiply the packed codes
  // from registers and more rows build the chunk's panel for the tiles. With
  // them, q8_0's (a byte per code, as packed) serve the tiles at every M;
  // 4-bit ones serve nibble_columns up to nibble_panel_rows() and the tiles above.
  constexpr bool q8 = T == QType::Q8_0;
  // few rows read packed q8_0 panels in place, and table-index ones as nibbles
  const bool packed_panels = a.panels && q8 && (q8_packed(a) || q8_table(a));
  // other panels are read in place by few rows up to the core's crossover (int8.h)
  const bool byte_panels = a.panels && q8 && !packed_panels;
  const bool few = !byte_panels && a.M <= (a.panels ? nibble_panel_rows() : kDirectRows);
  if (!few && !a.panels && !q8) return tiles<T>(a, scratch_nibble_panel<T>(a, n0, n1, scratch), 0, a.M, n0, n1);
  // persistent: read in place (packed q8_0's widened to bytes for the tiles)
  const PanelView p = chunk_panel(a, n0, n1, few || (a.panels && !packed_panels), scratch);
  if (!few) return tiles<T>(a, float_scales(p, T, a.blocks(), scratch), 0, a.M, n0, n1);
  __mmask16 mask[kCols];
  column_masks(n0, n1, mask);
  if (a.panels) {  // in passes of up to kNibbleRows x rows (a second pass reads the chunk from L2)
    static constexpr auto packed = packed_panel_table(std::make_integer_sequence<int, kDirectRows>());
    const int64_t passes = (a.M + kNibbleRows - 1) / kNibbleRows;
    for (int64_t i = 0, r0 = 0; i < passes; ++i) {
      const int64_t count = a.M / passes + (i < a.M % passes);
      (q8_packed(a) ? packed : nibble)[size_t(count - 1)](x_rows(a, r0, count), p, n0, mask);
      r0 += count;
    }
    return;
  }
  if constexpr (q8) {
    if (q8_packed(a)) {
      static constexpr auto packed = packed_q8_table(std::make_integer_sequence<int, kDirectRows>());
      for (int c = 0; c < kCols && mask[c]; ++c) packed[size_t(a.M - 1)](a, p, n0 + c * kLanes, c, mask[c]);
      return;
    }
  }
  for (int c = 0; c < kCols && mask[c]; ++c) direct[size_t(a.M - 1)](a, p, n0 + c * kLanes, c, mask[c]);
}

}  // namespace

void byte_panel_codes(const int8_t* codes, int64_t K, int rows, uint8_t* dst) {
  LinearArgs a{};  // q8_0's rows of K codes: their panel is this one
  a.qtype = QType::Q8_0;
  a.N = rows;
  a.K = K;
  a.qs = reinterpret_cast<const uint8_t*>(codes);
  const PanelView p{dst, nullptr, nullptr};
  for (int c = 0; c < kCols; ++c)
    build_column<QType::Q8_0>(a, c * kLanes, int(std::clamp<int64_t>(rows - c * kLanes, 0, kLanes)), c, p);
}

// x's blocks quantized as int8.h defines (bitwise the scalar build's), 32
// values in two vectors: |x| and a finiteness test, the maximum, one scalar
// division for dx, then per vector a division, clamp, rounding to nearest
// even (explicitly, whatever MXCSR says) and a narrowing store.
void x8_quantize(const float* x, int64_t K, QType t, int8_t* codes, float* dx, int32_t* corr,
                 float* xs) {
  const int32_t offset = unsigned_offset(t);
  const __m512 limit = _mm512_set1_ps(float(kI8Max)), inf = _mm512_set1_ps(INFINITY);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 v[2] = {_mm512_loadu_ps(x + b * kBlock), _mm512_loadu_ps(x + b * kBlock + 16)};
    const __m512 abs[2] = {_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])};
    const bool finite =
        (_mm512_cmp_ps_mask(abs[0], inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(abs[1], inf, _CMP_LT_OQ)) == 0xFFFF;
    float scale = finite ? _mm512_reduce_max_ps(_mm512_max_ps(abs[0], abs[1])) / float(kI8Max) : NAN;
    __m512i q[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (scale > 0.f)
      for (int h = 0; h < 2; ++h) {
        const __m512 ratio = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v[h], _mm512_set1_ps(scale)), -limit), limit);
        q[h] = _mm512_cvt_roundps_epi32(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
    for (int h = 0; h < 2; ++h)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(q[h]));
    // one horizontal sum per block, not per half (integer sums: the same value)
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
    dx[b] = scale;
    corr[b] = -offset * sum;
    xs[b] = scale * float(sum);
  }
}

// int8x2's low term, the scalar definition (kernel_i8_scalar.cpp) in vector
// lanes: the same exact IEEE steps (multiply and subtract with an explicit
// rounding mode, so the compiler cannot fuse them into an fma; division,
// clamp, round half to even), so bitwise equal, and vectorized: the plain
// C++ one showed in serving profiles.
void x8_low_term(const float* x, int64_t K, QType t, const int8_t* hi, int8_t* lo, float* dx,
                 int32_t* lo_corr, float* xs) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const int32_t offset = unsigned_offset(t);
  const __m512 limit = _mm512_set1_ps(float(kI8Max)), magic = _mm512_set1_ps(kI8RoundMagic);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float d = dx[b], s = d * kI8LowScale;  // exact: a power of two (unless dx is subnormal)
    __m512i hi_sums = _mm512_setzero_si512(), lo_sums = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const int64_t at = b * kBlock + 16 * h;
      const __m512i hq = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + at)));
      __m512i q = _mm512_setzero_si512();
      if (s > 0.f) {  // not for a zero block or a NaN dx (the row is NaN anyway)
        const __m512 dhi = _mm512_mul_round_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(hq), kRound);
        const __m512 res = _mm512_sub_round_ps(_mm512_loadu_ps(x + at), dhi, kRound);
        __m512 v = _mm512_div_ps(res, _mm512_set1_ps(s));
        v = _mm512_min_ps(_mm512_max_ps(v, -limit), limit);
        v = _mm512_sub_round_ps(_mm512_add_round_ps(v, magic, kRound), magic, kRound);
        q = _mm512_cvttps_epi32(v);  // v is an integer: exact
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + at), _mm512_cvtepi32_epi8(q));
      hi_sums = _mm512_add_epi32(hi_sums, hq);
      lo_sums = _mm512_add_epi32(lo_sums, q);
    }
    // two horizontal sums per block, not four (integer sums: the same values)
    const int32_t sum_hi = _mm512_reduce_add_epi32(hi_sums), sum_lo = _mm512_reduce_add_epi32(lo_sums);
    const int32_t sum = sum_hi * 256 + sum_lo;  // |sum| <= 32 * 32639 < 2^24: exact as a float
    dx[b] = s;
    lo_corr[b] = -offset * sum_lo;
    xs[b] = s * float(sum);
  }
}

PAGED_TARGET_END()  // baseline: panel_chunk_bytes

int64_t panel_chunk_bytes(const LinearArgs& a, PanelScales scales) {
  if (a.qtype == QType::S16) return s16_panel_chunk_bytes(a, scales);
  const int64_t nb = a.blocks();
  const int64_t codes = q8_packed(a)                               ? kPackedQ8BlockBytes
                        : a.qtype == QType::Q8_0 && !q8_table(a) ? kBlockBytes
                                                                 : kNibbleBlockBytes;
  return nb * codes + panel_scale_bytes(a.qtype, nb, scales);
}

namespace {

// Rows n0 .. n0 + kPanel of compact scales c8 (zero past n1) as a compact
// form's panel bytes [nb][kPanel] and supers [nb / 8][kPanel] (each the
// form's width): a transpose, once per matrix.
void transpose_compact_bytes(const uint8_t* c8, int64_t K, int64_t n0, int64_t n1, PanelScales form, int8_t* bytes,
                             uint8_t* supers) {
  const int64_t nb = K / kBlock, row_bytes = compact_row_bytes(nb, K);
  for (int64_t i = 0; i < kPanel; ++i) {
    const uint8_t* row = n0 + i < n1 ? c8 + (n0 + i) * row_bytes : nullptr;
    for (int64_t b = 0; b < nb; ++b) bytes[b * kPanel + i] = row ? int8_t(row[b]) : 0;
    for (int64_t g = 0; g < nb / kBlocksPerSuper; ++g) {
      float super = 0.f;
      if (row) std::memcpy(&super, row + nb + 4 * g, sizeof super);
      store_panel_super(supers + (g * kPanel + i) * super_bytes(form), form, super);
    }
  }
}

// Row i of column c of a compact panel's bytes and supers back into its compact scales row.
void compact_row(const int8_t* bytes, const uint8_t* supers, PanelScales form, int64_t nb, int64_t lane, uint8_t* row) {
  for (int64_t b = 0; b < nb; ++b) row[b] = uint8_t(bytes[b * kPanel + lane]);
  for (int64_t g = 0; g < nb / kBlocksPerSuper; ++g) {
    const float super = panel_super(supers + (g * kPanel + lane) * super_bytes(form), form);
    std::memcpy(row + nb + 4 * g, &super, 4);
  }
}

// Block b's scale of panel lane `lane` as the float32 the weight holds.
float scale_value(const PanelView& p, bool offsets, int64_t b, int64_t lane) {
  const int64_t at = b * kPanel + lane;
  if (p.scales == PanelScales::F16) return attn::f16_to_float((offsets ? p.m16 : p.d16)[at]);
  return (offsets ? p.m : p.d)[at];  // Compact scales go back as they are (compact_row)
}

}  // namespace

// build_panel_chunk's inverse, index by index (once per matrix, off the hot path).
void unpack_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, const uint8_t* src) {
  if (a.qtype == QType::S16) return s16_unpack_panel_chunk(a, n0, n1, src);
  const int64_t nb = a.blocks(), row_bytes = a.row_bytes();
  const PanelView p = chunk_view(src, a);
  const bool q8 = a.qtype == QType::Q8_0 && !p.table, q4_1 = a.qtype == QType::Q4_1;  // q8: byte codes
  auto* qs = const_cast<uint8_t*>(a.qs);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t lane = n - n0, c = lane / kLanes, i = lane % kLanes;
    uint8_t* row = qs + n * row_bytes;
    for (int64_t b = 0; p.packed_q8 && b < nb; ++b)  // a packed block is its 5 dwords
      for (int s = 0; s < kPackedQ8Dwords; ++s)
        std::memcpy(row + b * kQ8PackedBlockBytes + 4 * s, p.packed_q8 + packed_q8_offset(b, s, int(c)) + 4 * i, 4);
    for (int64_t b = 0; !p.packed_q8 && b < nb; ++b)
      for (int s = 0; s < (q8 ? kSteps : 4); ++s)
        for (int e = 0; e < 4; ++e)
          row[b * (q8 ? kBlock : kBlock / 2) + 4 * s + e] =
              q8 ? uint8_t(p.codes[b * kBlockBytes + (s * kCols + c) * 64 + 4 * i + e] ^ 0x80)
                 : p.nibbles[nibble_offset(b, s, int(c)) + 4 * i + e];
    if (compact_form(p.scales)) {
      const int64_t scale_bytes = compact_row_bytes(nb, a.K);
      compact_row(p.d8, p.d_super, p.scales, nb, lane, const_cast<uint8_t*>(a.d8) + n * scale_bytes);
      if (q4_1) compact_row(p.m8, p.m_super, p.scales, nb, lane, const_cast<uint8_t*>(a.m8) + n * scale_bytes);
      continue;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const_cast<float*>(a.d)[n * nb + b] = scale_value(p, false, b, lane);
      if (q4_1) const_cast<float*>(a.m)[n * nb + b] = scale_value(p, true, b, lane);
    }
  }
}

PAGED_TARGET_BEGIN(PAGED_VNNI512_ISA)
namespace {

// A chunk's F32 scales as fp16 (exact: the caller checked that they are fp16 values).
void narrow_scales(const float* f32, int64_t values, uint16_t* f16) {
  for (int64_t i = 0; i < values; i += kLanes)
    _mm256_store_si256(reinterpret_cast<__m256i*>(f16 + i),
                       _mm512_cvtps_ph(_mm512_load_ps(f32 + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <QType T>
void build_chunk(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst) {
  const int64_t nb = a.blocks();
  __mmask16 mask[kCols];
  column_masks(n0, n1, mask);
  PanelView p = chunk_view(dst, a);
  for (int c = 0; c < kCols; ++c) build_column<T>(a, n0 + c * kLanes, __builtin_popcount(mask[c]), c, p);
  if (p.scales == PanelScales::F32) return build<T>(a, n0, mask, true, p);  // the scales
  if (compact_form(p.scales)) {
    // q4_1 (Q4_K) and q8_0 (IQ4_XS); q4_1's always with compact m (checked at the boundary)
    transpose_compact_bytes(a.d8, a.K, n0, n1, p.scales, const_cast<int8_t*>(p.d8), const_cast<uint8_t*>(p.d_super));
    if constexpr (T == QType::Q4_1)
      transpose_compact_bytes(a.m8, a.K, n0, n1, p.scales, const_cast<int8_t*>(p.m8), const_cast<uint8_t*>(p.m_super));
    return;
  }
  AlignedVector<float> wide(size_t((T == QType::Q4_1 ? 2 : 1) * nb * kPanel));  // the F32 form, then narrowed
  p.d = wide.data();
  p.m = T == QType::Q4_1 ? p.d + nb * kPanel : nullptr;
  for (int c = 0; c < kCols; ++c) build_scales<T>(a, n0 + c * kLanes, __builtin_popcount(mask[c]), c, p);
  narrow_scales(wide.data(), int64_t(wide.size()), const_cast<uint16_t*>(p.d16));
}

}  // namespace

void build_panel_chunk(const LinearArgs& a, int64_t n0, int64_t n1, uint8_t* dst) {
  switch (a.qtype) {
    case QType::Q4_0: build_chunk<QType::Q4_0>(a, n0, n1, dst); break;
    case QType::Q4_1: build_chunk<QType::Q4_1>(a, n0, n1, dst); break;
    case QType::Q8_0: build_chunk<QType::Q8_0>(a, n0, n1, dst); break;
    case QType::S16: s16_build_panel_chunk(a, n0, n1, dst); break;
  }
}

PAGED_TARGET_END()  // baseline: chunk_panel

PanelView chunk_panel(const LinearArgs& a, int64_t n0, int64_t n1, bool scales_only, Int8Panel& scratch) {
  const int64_t nb = a.blocks();
  if (a.panels) {
    const int64_t chunk = panel_chunk_bytes(a, a.panel_scales);
    PanelView p = chunk_view(a.panels + (n0 / kPanel) * chunk, a);
    p.ahead = (kAhead / kPanel) * chunk;
    // This build reads the codes where they lie (and prefetches the chunk
    // kAhead rows on as it does); the AMX builds want a 4-bit chunk's codes
    // as bytes: widened once per chunk (scratch.widened), prefetching.
    if (!scales_only && p.nibbles) {
      scratch.codes.resize(size_t(nb * kBlockBytes));
      if (scratch.widened != p.nibbles) widen_nibbles(p, nb, chunk, scratch.codes.data());
      scratch.widened = p.nibbles;
      p.codes = scratch.codes.data();
      p.ahead = 0;
    }
    if (!scales_only && p.packed_q8) {  // the tiles' bytes, once per chunk (the AMX builds' tiles too)
      scratch.codes.resize(size_t(nb * kBlockBytes));
      if (scratch.widened != p.packed_q8) widen_packed_q8(p, nb, chunk, scratch.codes.data());
      scratch.widened = p.packed_q8;
      p.codes = scratch.codes.data();
      p.ahead = 0;
    }
    return p;
  }
  scratch.d.resize(size_t(nb * kPanel));
  if (a.qtype == QType::Q4_1) scratch.m.resize(size_t(nb * kPanel));
  if (!scales_only) scratch.codes.resize(size_t(nb * kBlockBytes));
  const PanelView p{scratch.codes.data(), scratch.d.data(), scratch.m.data()};
  __mmask16 mask[kCols];
  column_masks(n0, n1, mask);
  switch (a.qtype) {
    case QType::Q4_0: build<QType::Q4_0>(a, n0, mask, scales_only, p); break;
    case QType::Q4_1: build<QType::Q4_1>(a, n0, mask, scales_only, p); break;
    case QType::Q8_0: build<QType::Q8_0>(a, n0, mask, scales_only, p); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
  return p;
}

PAGED_TARGET_BEGIN(PAGED_VNNI512_ISA)

void panel_rows(const LinearArgs& a, const PanelView& p, int64_t r0, int64_t r1, int64_t n0,
                int64_t n1) {
  switch (a.qtype) {
    case QType::Q4_0: tiles<QType::Q4_0>(a, p, r0, r1, n0, n1); break;
    case QType::Q4_1: tiles<QType::Q4_1>(a, p, r0, r1, n0, n1); break;
    case QType::Q8_0: tiles<QType::Q8_0>(a, p, r0, r1, n0, n1); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
}

void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel) {
  switch (a.qtype) {
    case QType::Q4_0: rows<QType::Q4_0>(a, n0, n1, panel); break;
    case QType::Q4_1: rows<QType::Q4_1>(a, n0, n1, panel); break;
    case QType::Q8_0: rows<QType::Q8_0>(a, n0, n1, panel); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
}

}  // namespace paged::cpu::linear::isa_avx512
PAGED_TARGET_END()

#pragma GCC diagnostic pop
