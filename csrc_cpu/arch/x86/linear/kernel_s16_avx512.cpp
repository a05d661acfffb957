// AVX-512 VNNI build of the s16 layout's kernel (s16.h), for the avx512 and
// amx builds; bitwise the scalar definition. The AVX2 kernel's two paths
// (kernel_s16_avx2.cpp) from the same pieces (s16_ymm.inc), on VNNI:
//  - prompt rows (more than kS16FewRows): the same int16 pair panel, read 16
//    weight rows per zmm (two of its 8-row columns lie side by side), each
//    slot one vpdpwssd per 16 outputs and x row: a half's sums for 4 x rows
//    by the item's 32 weight rows in 64 instructions, where the AVX2 tile
//    takes 256 (vpmaddwd, then vpaddd, on 8 rows a vector);
//  - one-term prompt rows (s16.h, kS16ByteBias): a byte panel instead (the
//    int8 build's q8_0 panel of the codes + 128), one vpdpbusd per 4 codes
//    of 16 weight rows and an x row: half the instructions of the pairs;
//  - few rows (decode): the AVX2 kernel with vpdpbusd for vpmaddubsw +
//    vpmaddwd (256-bit, AVX512VL): int8x2's two terms in 3 instructions
//    instead of 5;
//  - with persistent panels (s16_panels_avx512.cpp): up to s16_panel_rows()
//    rows their own kernel, more rows the tiles above on panels made from
//    them in registers (persistent_panel).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "arch/target.h"
#include "arch/x86/linear/int8_avx512.h"
#include "arch/x86/linear/s16_panel_avx512.h"
#include "linear/aligned.h"
#include "linear/compact_scales.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"

// GCC 12 reports its own AVX-512 intrinsic headers (the deliberately undefined
// pass-through operand __Y) as (maybe-)uninitialized: GCC bug 105593.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

PAGED_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace paged::cpu::linear::isa_avx512 {
namespace {

#include "arch/x86/linear/ymm_panel.inc"

// Sums of 4 products of unsigned bytes u by signed bytes x per int32 lane.
inline __m256i dot4(__m256i u, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x); }
// int8x2: 256 x the high term's sums, then the low term's added by vpdpbusd.
inline __m256i dot4x2(__m256i u, __m256i hi, __m256i lo) {
  return _mm256_dpbusd_epi32(_mm256_slli_epi32(dot4(u, hi), 8), u, lo);
}

#include "arch/x86/linear/s16_ymm.inc"

// ---- Prompt rows: 16 weight rows per vector ----

constexpr int kPairTileRows = 4;             // x rows per tile
constexpr int kZmmCols = 2;                  // zmm columns (16 weight rows) per tile: the whole item
constexpr int kPairTileCols = 2 * kZmmCols;  // the same in the panel's 8-row columns
static_assert(kPairTileCols == kCols, "a tile spans the work item");

// A half's exact sums for the item's 32 weight rows by R x rows (their
// block's pairs at x[r]): its 8 slots, each a vpdpwssd per zmm column.
template <int R, int H>
__attribute__((always_inline)) inline void half_pair_sums(const uint8_t* w, const int16_t* const x[R],
                                                          __m512i isum[R][kZmmCols]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kZmmCols; ++j) isum[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const int slot = kHalfSlots[H][i];
    __m512i wv[kZmmCols];
    for (int j = 0; j < kZmmCols; ++j) wv[j] = _mm512_load_si512(w + (slot * kCols + 2 * j) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + 2 * slot, sizeof pair);
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int j = 0; j < kZmmCols; ++j) isum[r][j] = _mm512_dpwssd_epi32(isum[r][j], wv[j], xb);
    }
  }
}

// The byte panel's half H of block b (its steps 4H .. 4H+3, each 4 codes of
// the item's 32 weight rows as u = q + 128) by R x rows' int8 codes: exact
// sums, started at -half_bias (s16.h).
template <int R, int H>
__attribute__((always_inline)) inline void half_byte_sums(const uint8_t* w, const S16Args& s, int64_t r0, int64_t b,
                                                          __m512i isum[R][kZmmCols]) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nh = K / kS16Half;
  for (int r = 0; r < R; ++r) {
    const __m512i start = _mm512_set1_epi32(-s.half_bias[(r0 + r) * nh + 2 * b + H]);
    for (int j = 0; j < kZmmCols; ++j) isum[r][j] = start;
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const int st = 4 * H + i;
    __m512i wv[kZmmCols];
    for (int j = 0; j < kZmmCols; ++j) wv[j] = _mm512_load_si512(w + (st * kZmmCols + j) * 64);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, a.x8 + (r0 + r) * K + b * kBlock + 4 * st, sizeof quad);
      const __m512i xb = _mm512_set1_epi32(quad);
      for (int j = 0; j < kZmmCols; ++j) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], wv[j], xb);
    }
  }
}

// A work item's byte panel (codes only; byte_panel_codes).
inline void byte_panel(const S16Args& s, int64_t n0, const int valid[kCols], PairPanel& p) {
  p.codes.resize(size_t(s.a->K / kBlock * kBlockBytes));
  int rows = 0;
  for (int c = 0; c < kCols; ++c) rows += valid[c];
  byte_panel_codes(s.row_codes(n0), s.a->K, rows, p.codes.data());
}

// out[r0 .. r0+R, the item's valid rows]: per block and half, the half's
// exact sums (Bytes: the byte panel by x's int8 codes; else the pair
// panel's 8 slots by x's pairs), then its chain's step; with offsets,
// chunk_offsets' sums added. Pairs (p.pairs): a block's halves share d, so
// the second half's steps reuse the first's d * dx (the same floats) from
// the stack, a load folded into the fma instead of a multiply (the tile is
// bound by the multiply pipes; the registers are taken by the chains).
template <int R, bool HasM, bool Bytes, bool Pairs>
void pair_tile_of(const S16Args& s, const PairPanel& p, int64_t r0, int64_t n0, int c0, const int valid[kCols]) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock;
  __m512 e[R][kZmmCols][2];
  alignas(64) float shared[Pairs ? R * kZmmCols * isa_avx512::kLanes : 1];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kZmmCols; ++j) e[r][j][0] = e[r][j][1] = _mm512_setzero_ps();
  const auto step = [&](int h, int64_t b, __m512i isum[R][kZmmCols]) __attribute__((always_inline)) {
    const int64_t g = 2 * b + h;
    for (int j = 0; j < kZmmCols; ++j) {
      if (Pairs && h == 1) {
        for (int r = 0; r < R; ++r)
          e[r][j][1] = _mm512_fmadd_ps(_mm512_load_ps(shared + (r * kZmmCols + j) * isa_avx512::kLanes),
                                       _mm512_cvtepi32_ps(isum[r][j]), e[r][j][1]);
        continue;
      }
      const __m512 d = _mm512_load_ps(p.d.data() + g * kPanel + (c0 + 2 * j) * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.x8_scale[(r0 + r) * nb + b]));
        if constexpr (Pairs) _mm512_store_ps(shared + (r * kZmmCols + j) * isa_avx512::kLanes, scale);
        e[r][j][h] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum[r][j]), e[r][j][h]);
      }
    }
  };
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][kZmmCols];
    if constexpr (Bytes) {  // the item's whole width (c0 == 0)
      const uint8_t* w = p.codes.data() + b * kBlockBytes;
      half_byte_sums<R, 0>(w, s, r0, b, isum);
      step(0, b, isum);
      half_byte_sums<R, 1>(w, s, r0, b, isum);
      step(1, b, isum);
    } else {
      const uint8_t* w = p.codes.data() + b * kPairBlockBytes + c0 * 32;
      const int16_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = s.c16 + (r0 + r) * K + b * kBlock;
      half_pair_sums<R, 0>(w, x, isum);
      step(0, b, isum);
      half_pair_sums<R, 1>(w, x, isum);
      step(1, b, isum);
    }
  }
  for (int j = 0; j < kZmmCols; ++j) {
    const int rows = valid[c0 + 2 * j] + valid[c0 + 2 * j + 1];  // the valid rows come first
    const auto mask = __mmask16((1u << rows) - 1);
    for (int r = 0; r < R; ++r) {
      __m512 out = _mm512_add_ps(e[r][j][0], e[r][j][1]);
      if constexpr (HasM)
        out = _mm512_add_ps(out, _mm512_load_ps(p.offsets.data() + (r0 + r) * kPanel + (c0 + 2 * j) * kLanes));
      _mm512_mask_storeu_ps(a.out + (r0 + r) * a.N + n0 + (c0 + 2 * j) * kLanes, mask, out);
    }
  }
}

template <int R, bool HasM, bool Bytes>
void pair_tile(const S16Args& s, const PairPanel& p, int64_t r0, int64_t n0, int c0, const int valid[kCols]) {
  if (p.pairs) return pair_tile_of<R, HasM, Bytes, true>(s, p, r0, n0, c0, valid);
  pair_tile_of<R, HasM, Bytes, false>(s, p, r0, n0, c0, valid);
}

// ---- Prompt rows on persistent panels (s16_panel_avx512.h) ----

// Chunk [n0, n1)'s tile panel from its persistent panel: per block and zmm
// column (16 rows) each step's codes u, as the byte panel's q + 128 (Bytes)
// or the pair panel's int16 pairs of q (its two 8-row columns); the scales
// widened into lanes; the offsets' sums by the scalar order in lanes
// (chunk_offsets' chains, 16 outputs a vector).
template <int Bits, bool Bytes>
void persistent_codes(const S16Column& col, int zc, int64_t nb, int bias, PairPanel& p) {
  const __m512i to_byte = _mm512_set1_epi8(char(128 - bias)), to_code = _mm512_set1_epi8(char(bias));
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int B = s16_base_bits(Bits), H = Bits - B;
    const uint8_t* w = col.codes + b * Bits * 64;
    __m512i base[B], high[H > 0 ? H : 1];
    for (int i = 0; i < B; ++i) base[i] = _mm512_load_si512(w + i * 64);
    for (int i = 0; i < H; ++i) high[i] = _mm512_load_si512(w + (B + i) * 64);
    const auto half = [&](auto hc) {
      constexpr int h = decltype(hc)::value;
      const auto step = [&](auto sc) {
        constexpr int st = decltype(sc)::value;
        const __m512i u = step_codes<Bits, h, st>(base, high);
        if constexpr (Bytes) {
          _mm512_store_si512(p.codes.data() + b * kBlockBytes + ((4 * h + st) * kZmmCols + zc) * 64,
                             _mm512_add_epi8(u, to_byte));
        } else {
          const __m512i q = _mm512_sub_epi8(u, to_code);
          uint8_t* block = p.codes.data() + b * kPairBlockBytes;
          store_pairs(block + (2 * zc) * 32, 4 * h + st, _mm512_castsi512_si256(q));
          store_pairs(block + (2 * zc + 1) * 32, 4 * h + st, _mm512_extracti64x4_epi64(q, 1));
        }
      };
      step(std::integral_constant<int, 0>{});
      step(std::integral_constant<int, 1>{});
      step(std::integral_constant<int, 2>{});
      step(std::integral_constant<int, 3>{});
    };
    half(std::integral_constant<int, 0>{});
    half(std::integral_constant<int, 1>{});
  }
}

template <bool Bytes>
void persistent_panel(const S16Args& s, int64_t n0, int64_t, const int[kCols], PairPanel& p) {
  const LinearArgs& a = *s.a;
  const S16Shape sh(a, a.panel_scales);
  const uint8_t* chunk = s16_chunk(a, n0);
  constexpr int64_t zmm_lanes = isa_avx512::kLanes;
  p.d.resize(size_t(sh.nh * kPanel));
  p.pairs = pairs_form(sh.form);
  p.codes.resize(size_t(sh.nb * (Bytes ? kBlockBytes : kPairBlockBytes)));
  if (sh.offsets) p.offsets.resize(size_t(a.M * kPanel));
  for (int zc = 0; zc < kZmmCols; ++zc) {
    const S16Column col = sh.column(chunk, zc);
    for (int64_t g = 0; g < sh.nh; ++g) _mm512_store_ps(p.d.data() + g * kPanel + zc * zmm_lanes, lane_scales(col, 0, g));
    switch (sh.bits) {
      case 2: persistent_codes<2, Bytes>(col, zc, sh.nb, a.code_bias, p); break;
      case 3: persistent_codes<3, Bytes>(col, zc, sh.nb, a.code_bias, p); break;
      case 4: persistent_codes<4, Bytes>(col, zc, sh.nb, a.code_bias, p); break;
      case 5: persistent_codes<5, Bytes>(col, zc, sh.nb, a.code_bias, p); break;
      default: persistent_codes<6, Bytes>(col, zc, sh.nb, a.code_bias, p); break;
    }
    if (sh.offsets) column_offsets(col, s.xs, a.M, {p.offsets.data() + zc * zmm_lanes, kPanel, 0xFFFF, false});
  }
}

template <bool HasM, bool Bytes, int... R>
constexpr std::array<PairTileFn, sizeof...(R)> pair_tile_table(std::integer_sequence<int, R...>) {
  return {&pair_tile<R + 1, HasM, Bytes>...};
}

}  // namespace

void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  using Rows = std::make_integer_sequence<int, kPairTileRows>;
  static constexpr auto plain = pair_tile_table<false, false>(Rows());
  static constexpr auto offset = pair_tile_table<true, false>(Rows());
  static constexpr auto byte_plain = pair_tile_table<false, true>(Rows());
  static constexpr auto byte_offset = pair_tile_table<true, true>(Rows());
  const bool bytes = s.a->M > kFewRows && !s.c16;  // one term, on bytes (the driver gave half_bias, no c16: s16.h)
  if (s.a->panels) {  // persistent panels (s16_panels_avx512.cpp)
    if (s.a->M <= s16_panel_rows()) return s16_panel_few_rows(s, n0, n1);
    if (bytes) return rows_with_tiles(s, n0, n1, byte_plain, byte_offset, kPairTileCols, persistent_panel<true>);
    return rows_with_tiles(s, n0, n1, plain, offset, kPairTileCols, persistent_panel<false>);
  }
  if (bytes) return rows_with_tiles(s, n0, n1, byte_plain, byte_offset, kPairTileCols, weight_panel<byte_panel>);
  rows_with_tiles(s, n0, n1, plain, offset, kPairTileCols);
}

}  // namespace paged::cpu::linear::isa_avx512

PAGED_TARGET_END()

#pragma GCC diagnostic pop
