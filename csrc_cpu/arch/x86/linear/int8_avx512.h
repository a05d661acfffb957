// What the AMX build of the int8 path (kernel_i8_amx.cpp) shares with the
// AVX-512 VNNI build (kernel_i8_avx512.cpp): the weight panel of a work item
// -- its layout is exactly what a tdpbsud B tile of one block and 16 weight
// rows wants -- and the VNNI register tiles over it, which serve the calls
// AMX leaves to VNNI. Both builds' arithmetic is int8.h's, bitwise.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "arch/target.h"
#include "linear/compact_scales.h"
#include "linear/int8.h"

namespace paged::cpu::linear::isa_avx512 {

constexpr int kLanes = 16;                    // weight rows per zmm (one column)
constexpr int kCols = 2;                      // columns per panel and tile
constexpr int64_t kPanel = kLanes * kCols;    // weight rows per panel
constexpr int kSteps = kBlock / 4;            // vpdpbusd steps per block (4 codes each)
constexpr int64_t kBlockBytes = int64_t(kSteps) * kPanel * 4;  // a block of the panel's codes
constexpr int64_t kAhead = 2 * kI8ChunkRows;  // weight rows between a line read and its prefetch
static_assert(kPanel == kI8ChunkRows, "a work item is one panel");
// A block of a persistent 4-bit panel's codes as nibbles: [4][kCols][kLanes][4]
// bytes, dword s of each row (codes 4s.. in the low nibbles, 16 + 4s.. in the high).
constexpr int64_t kNibbleBlockBytes = kBlockBytes / 2;
constexpr int64_t nibble_offset(int64_t b, int s, int c) { return ((b * 4 + s) * kCols + c) * 64; }
// A block of a persistent packed q8_0 panel (q8_packed.h): the packed rows'
// 5 dwords per block transposed, [5][kCols][kLanes][4] bytes (4 of nibbles,
// then the fifth bits): as many bytes as the packed codes.
constexpr int kPackedQ8Dwords = 5;
constexpr int64_t kPackedQ8BlockBytes = kPackedQ8Dwords * kCols * 64;
constexpr int64_t packed_q8_offset(int64_t b, int s, int c) { return ((b * kPackedQ8Dwords + s) * kCols + c) * 64; }

// Where a chunk's panel lives: the thread's scratch (Int8Panel), or the
// caller's persistent copy (build_panel_chunk: codes, then d, then q4_1's m,
// in the panels' scale form, PanelScales). A persistent 4-bit panel keeps
// its codes as nibbles (half the bytes: at decode they stream from memory),
// which the VNNI build reads in place and chunk_panel widens to bytes for
// the AMX builds' tiles. Kernels read the scales through panel_scale.
struct PanelView {
  // [nb][kSteps][kCols][kLanes][4]: block b's codes 4s .. 4s+3 of column c's
  // row i at ((b * kSteps + s) * kCols + c) * 64 + 4 * i (unsigned: the
  // nibble, or the q8 code + 128); null in a persistent 4-bit view
  uint8_t* codes;
  float* d;  // [nb][kPanel] (PanelScales::F32)
  float* m;  // [nb][kPanel], q4_1 only
  // A persistent panel streams from memory: while block b is swept, its
  // share (1/nb) of the chunk `ahead` bytes on (the thread's item after
  // next) is prefetched into L2, as the packed rows' reads do.
  int64_t ahead = 0;
  uint8_t* nibbles = nullptr;  // [nb] blocks of kNibbleBlockBytes (nibble_offset), persistent 4-bit panels
  uint8_t* packed_q8 = nullptr;  // [nb] blocks of kPackedQ8BlockBytes (packed_q8_offset), persistent packed q8_0
  // the nibbles are q8_0's IQ4_NL table indices (q8_packed.h): each step's
  // u = value + 128 is looked up (table_steps) where the 4-bit types' is the nibble
  bool table = false;
  PanelScales scales = PanelScales::F32;
  const uint16_t* d16 = nullptr;  // F16: [nb][kPanel] fp16 d, then q4_1's m
  const uint16_t* m16 = nullptr;
  const int8_t* d8 = nullptr;     // Compact: [nb][kPanel] bytes of d, then m,
  const int8_t* m8 = nullptr;
  const uint8_t* d_super = nullptr;  // then [nb / 8][kPanel] supers of d, then m (float32, or fp16 in CompactF16)
  const uint8_t* m_super = nullptr;
};

// Blocks per super value of compact scales (compact_scales.h).
constexpr int64_t kBlocksPerSuper = kCompactWeights / kBlock;

// Chunk bytes of a panel's scales: per block, kPanel values of d (and q4_1's m).
constexpr int64_t panel_scale_bytes(QType t, int64_t nb, PanelScales form) {
  const int64_t per_block = form == PanelScales::F32 ? 4 * kPanel
                            : form == PanelScales::F16 ? 2 * kPanel
                                                       : kPanel + super_bytes(form) * kPanel / kBlocksPerSuper;
  return (t == QType::Q4_1 ? 2 : 1) * nb * per_block;
}

PAGED_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
// Block b's d (or, `offsets`, q4_1's m) of column c's 16 rows, as float32:
// fp16 widened, or compact fl(super * float(byte)) -- the values the
// F32 form holds, bit for bit.
inline __attribute__((always_inline)) __m512 panel_scale(const PanelView& p, bool offsets, int64_t b, int c) {
  const int64_t at = b * kPanel + c * kLanes;
  switch (p.scales) {
    case PanelScales::F16:
      return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>((offsets ? p.m16 : p.d16) + at)));
    case PanelScales::Compact:
    case PanelScales::CompactF16:
    case PanelScales::CompactPairs:  // (the pairs forms: s16 only, never a q4 / q8 panel's)
    case PanelScales::CompactPairsF16: {
      const int64_t w = super_bytes(p.scales);
      const uint8_t* super = (offsets ? p.m_super : p.d_super) + ((b / kBlocksPerSuper) * kPanel + c * kLanes) * w;
      const __m512 sv = w == 2 ? _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(super)))
                               : _mm512_load_ps(reinterpret_cast<const float*>(super));
      const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>((offsets ? p.m8 : p.d8) + at));
      return _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    }
    case PanelScales::F32: break;
  }
  return _mm512_load_ps((offsets ? p.m : p.d) + at);
}
// 4 int8 codes at p in every dword lane: a vpdpbusd operand (x's codes of one step).
PAGED_ALWAYS_INLINE __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}
PAGED_TARGET_END()

// Chunk [n0, n1)'s panel for this call: a view of the persistent one
// (a.panels; with `scales_only` false, a 4-bit one's codes widened to bytes
// in `scratch`), else built into `scratch` (codes unless `scales_only`).
PanelView chunk_panel(const LinearArgs& a, int64_t n0, int64_t n1, bool scales_only, Int8Panel& scratch);
// Rows [0, rows) (at most kPanel) of int8 codes, K apart, as a panel's byte
// codes (PanelView::codes' layout, the code + 128: q8_0's panel), into dst
// (K / kBlock * kBlockBytes bytes, 64-byte aligned): s16's one-term prompt
// rows (kernel_s16_avx512.cpp).
void byte_panel_codes(const int8_t* codes, int64_t K, int rows, uint8_t* dst);
// out[r0 .. r1, n0 .. n1] from a panel with codes, by the VNNI register tiles.
void panel_rows(const LinearArgs& a, const PanelView& p, int64_t r0, int64_t r1, int64_t n0, int64_t n1);

}  // namespace paged::cpu::linear::isa_avx512
