// AMX build of the int8 path (int8.h), bitwise equal to the scalar build:
// the block sums come from the tile unit (tdpbsud: signed x codes times the
// unsigned weight codes, exact int32), then per output the same fp32 steps as
// every build (one multiply d * dx, one fma per block, q4_1's fma with m) in
// AVX-512 lanes. int8x2's low codes take a second tdpbsud and fold in as
// hi * 256 + lo.
//
// Layout: a tdpbsud multiplies an A tile of 16 x rows by 32 codes (one
// block) with a B tile of 8 rows of 16 weight rows x 4 codes, which is the
// AVX-512 build's panel of one block and column as it lies (int8_avx512.h),
// so both builds share the panels (persistent or built per call) and their
// layout name. A work item is that build's (32 weight rows, 2 columns of 16);
// per column and group of 16 x rows, 16 zmm accumulators (row r: outputs
// n0 + 16c ..) stay in registers while the blocks go by: block b + 1's tile
// loads, dot product and store to the thread's buffer are issued before
// block b's sums are read back and run through the fp32 steps.
//
// A tdpbsud over one block does 16 x 16 x 32 multiply-adds (a K of 64 bytes
// costs the same, but blocks of 32 have their own scales), far more than
// zmm vpdpbusd. What bounds it are the fp32 steps (4 vector ops per 16
// outputs and block for q4_1, 6 with int8x2's fold), which did not overlap
// with the tile work in any schedule tried: in the engine it is no faster
// than the VNNI build (docs/kernels.md, "AMX"), so it is opt-in. Calls of
// fewer than kAmxMinRows rows are the VNNI build's (the weight streams
// there; a tile of few rows wastes the unit).
//
// Tiles load 16 rows of x codes at a time: the last group of a call reads
// up to 15 rows past M, which int8.h's kI8PadRows makes every caller
// allocate; those rows' sums are never read.
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "arch/x86/amx/amx_tiles.h"
#include "arch/x86/linear/int8_avx512.h"

PAGED_TARGET_BEGIN(PAGED_AMX_ISA)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in the AVX-512 build
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace paged::cpu::linear::isa_amx {
namespace {

using isa_avx512::kBlockBytes;
using isa_avx512::kCols;
using isa_avx512::kLanes;
using isa_avx512::kPanel;
using isa_avx512::PanelView;

constexpr int kGroup = 16;  // x rows per A tile
static_assert(kGroup - 1 <= kI8PadRows, "the last group's tile reads up to kGroup - 1 rows past M");
// Calls of fewer rows stay on the VNNI build: its direct path reads the
// packed weight, which streams at such M.
constexpr int64_t kAmxMinRows = 8;

// The tiles, rotated by the parity of the block so that block b + 1's loads
// and dot products need not wait for block b's tiles to be read. int8: x
// codes X[p], weights W[p], sums S[p]; int8x2 keeps one X and XLo (8 tiles in all).
constexpr int kX[2] = {0, 1}, kW[2] = {2, 3}, kS[2] = {4, 5};
constexpr int kX2 = 0, kXLo2 = 1, kSLo[2] = {6, 7};

// The tile configuration (palette 1) every call of this build runs under.
constexpr amx::TileConfig make_config() {
  amx::TileConfig c;
  for (int t : {0, 1}) c.rows[t] = kGroup, c.bytes_per_row[t] = kBlock;                // x codes
  for (int t : {2, 3}) c.rows[t] = kBlock / 4, c.bytes_per_row[t] = 4 * kLanes;        // a block of 16 weight rows
  for (int t : {4, 5, 6, 7}) c.rows[t] = kGroup, c.bytes_per_row[t] = 4 * kLanes;      // 16 x 16 int32 sums
  return c;
}
constexpr amx::TileConfig kConfig = make_config();

using amx::tile_load;
using amx::tile_store;
using amx::tile_zero;
template <int S, int X, int W>
PAGED_ALWAYS_INLINE void tile_dot() {
  amx::tile_dot_i8<S, X, W>();
}

PAGED_ALWAYS_INLINE void prefetch_ahead(const void* p, int64_t ahead) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + uintptr_t(ahead)), _MM_HINT_T1);
}

// The thread's landing place for block sums: two blocks in flight (by
// parity), each the high (and int8x2's low) sums of a 16 x 16 tile.
struct alignas(64) SumBuffer {
  int32_t sums[2][2][kGroup * kLanes];
};

// One column pass: out[r0 .. r0+R, n0 + 16c .. +16] (lanes outside `mask`
// not stored), R <= kGroup; Two: int8x2 (a.x8_lo set).
template <QType T, bool Two, int R>
struct Column {
  const LinearArgs& a;
  const PanelView& p;
  const int8_t* x;     // the group's codes, block 0
  const int8_t* x_lo;  // int8x2's low codes
  const uint8_t* w;    // the column's weight codes, block 0
  SumBuffer& buf;
  __m512 acc[R];

  // Block b's tile products into buf.sums[P] (P = b's parity).
  template <int P>
  PAGED_ALWAYS_INLINE void sums(int64_t b) {
    tile_load<kW[P]>(w + b * kBlockBytes, kCols * 4 * kLanes);
    if constexpr (Two) {
      tile_load<kX2>(x + b * kBlock, a.K);
      tile_load<kXLo2>(x_lo + b * kBlock, a.K);
      tile_zero<kS[P]>();
      tile_zero<kSLo[P]>();
      tile_dot<kS[P], kX2, kW[P]>();
      tile_dot<kSLo[P], kXLo2, kW[P]>();
      tile_store<kS[P]>(buf.sums[P][0], 4 * kLanes);
      tile_store<kSLo[P]>(buf.sums[P][1], 4 * kLanes);
    } else {
      tile_load<kX[P]>(x + b * kBlock, a.K);
      tile_zero<kS[P]>();
      tile_dot<kS[P], kX[P], kW[P]>();
      tile_store<kS[P]>(buf.sums[P][0], 4 * kLanes);
    }
  }

  // Block b's fp32 steps (int8.h) from buf.sums[P]: per row of x one
  // convert, multiply and fma (int8x2: the fold first; q4_0 / q8_0: corr
  // added; q4_1: its offsets' fma), with the row's block values read from
  // one pointer each (block-major).
  template <int P>
  PAGED_ALWAYS_INLINE void steps(int64_t b, int c, int64_t r0) {
    const int64_t at = b * a.x8_bm.ld + r0;
    const float* const dx = a.x8_bm.scale + at;
    const float* const xs = a.x8_bm.sum + at;
    const int32_t* const corr = a.x8_bm.corr + at;
    const __m512 d = isa_avx512::panel_scale(p, false, b, c);
    const __m512 m = T == QType::Q4_1 ? isa_avx512::panel_scale(p, true, b, c) : _mm512_setzero_ps();
    const int32_t* const hi = buf.sums[P][0];
    const int32_t* const lo = buf.sums[P][1];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i isum = _mm512_load_si512(hi + r * kLanes);
      if constexpr (Two) isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 8), _mm512_load_si512(lo + r * kLanes));
      if constexpr (T != QType::Q4_1) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(corr[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r])), _mm512_cvtepi32_ps(isum), acc[r]);
      if constexpr (T == QType::Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r]), acc[r]);
    }
  }

  PAGED_ALWAYS_INLINE void run(int64_t r0, int64_t n0, int c, __mmask16 mask) {
    const int64_t nb = a.blocks();
    // A persistent panel: the item after next's lines, spread over the
    // blocks of the first pass (as the VNNI tiles do).
    const bool prefetch = p.ahead && r0 == 0 && c == 0;
    const int64_t share = p.ahead / (isa_avx512::kAhead / kPanel) / nb;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    sums<0>(0);
    for (int64_t b = 0; b < nb; b += 2) {  // block b in the even tiles, b + 1 in the odd ones
      if (b + 1 < nb) sums<1>(b + 1);
      if (prefetch)
        for (int64_t at = b * share; at < std::min(nb, b + 2) * share; at += 64) prefetch_ahead(p.codes + at, p.ahead);
      steps<0>(b, c, r0);
      if (b + 1 >= nb) break;
      if (b + 2 < nb) sums<0>(b + 2);
      steps<1>(b + 1, c, r0);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(a.out + (r0 + r) * a.N + n0 + c * kLanes, mask, acc[r]);
  }
};

template <QType T, bool Two, int R>
void column(const LinearArgs& a, const PanelView& p, int64_t r0, int64_t n0, int c, __mmask16 mask,
            SumBuffer& buf) {
  Column<T, Two, R> col{a, p, a.x8 + r0 * a.K, Two ? a.x8_lo + r0 * a.K : nullptr, p.codes + c * 4 * kLanes, buf, {}};
  col.run(r0, n0, c, mask);
}

using ColumnFn = void (*)(const LinearArgs&, const PanelView&, int64_t r0, int64_t n0, int c, __mmask16 mask,
                          SumBuffer& buf);
template <QType T, bool Two, int... R>
constexpr std::array<ColumnFn, sizeof...(R)> column_table(std::integer_sequence<int, R...>) {
  return {&column<T, Two, R + 1>...};
}

// Groups of 16 rows of x, each swept over the chunk's two columns.
template <QType T, bool Two>
void rows(const LinearArgs& a, const PanelView& p, int64_t n0, int64_t n1) {
  static constexpr auto table = column_table<T, Two>(std::make_integer_sequence<int, kGroup>());
  static thread_local SumBuffer buf;
  amx::ensure_config(kConfig);
  for (int64_t r0 = 0; r0 < a.M; r0 += kGroup)
    for (int c = 0; c < kCols && n0 + c * kLanes < n1; ++c) {
      const int valid = int(std::min<int64_t>(kLanes, n1 - n0 - c * kLanes));
      table[size_t(std::min<int64_t>(kGroup, a.M - r0) - 1)](a, p, r0, n0, c, __mmask16((1u << valid) - 1), buf);
    }
}

template <QType T>
void rows(const LinearArgs& a, const PanelView& p, int64_t n0, int64_t n1) {
  if (a.x8_lo) return rows<T, true>(a, p, n0, n1);
  rows<T, false>(a, p, n0, n1);
}

}  // namespace

void int8_rows(const LinearArgs& a, int64_t n0, int64_t n1, Int8Panel& panel) {
  // few rows, or a caller without the block-major values: the VNNI build
  if (a.M < kAmxMinRows || !a.x8_bm.scale) return isa_avx512::int8_rows(a, n0, n1, panel);
  const PanelView p = isa_avx512::chunk_panel(a, n0, n1, false, panel);
  switch (a.qtype) {
    case QType::Q4_0: rows<QType::Q4_0>(a, p, n0, n1); break;
    case QType::Q4_1: rows<QType::Q4_1>(a, p, n0, n1); break;
    case QType::Q8_0: rows<QType::Q8_0>(a, p, n0, n1); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
}

}  // namespace paged::cpu::linear::isa_amx

#pragma GCC diagnostic pop
PAGED_TARGET_END()
