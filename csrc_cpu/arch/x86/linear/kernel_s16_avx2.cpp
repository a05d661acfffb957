// AVX2 build of the s16 layout's kernel (s16.h), shared by every x86 build
// past scalar; bitwise the scalar definition. Two paths by the call's rows:
//  - more than kS16FewRows (8) rows (prompts, batches): a work item's 32 weight
//    rows become an int16 pair panel (ymm_panel.inc: 8 weight rows per
//    vector, the int8 path's q8_0 pair layout), so a half's exact sum for 8
//    outputs is 8 vpmaddwd of weight pairs by a broadcast pair of x's codes
//    c (int8 and int8x2 alike: c16), then one convert, d * dx and fma per
//    half and 8 outputs (pair_tile);
//  - up to kS16FewRows rows (decode): each weight row's block as it lies
//    (bytes, or packed codes read in place) by x's bytes, vpmaddubsw +
//    vpmaddwd into its 8 lane sums, and 4 outputs' lane sums reduced to
//    their half sums in one vector, [first halves | second halves]: the
//    definition's two chains side by side (few_rows).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "arch/target.h"
#include "linear/aligned.h"
#include "linear/int8.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma")

namespace paged::cpu::linear::isa_avx2 {
namespace {

#include "arch/x86/linear/ymm_panel.inc"

constexpr int64_t kFewRows = kS16FewRows;  // calls of up to this many rows take few_rows (no c16)
static_assert(kPanel == kI8ChunkRows, "a work item is one panel");

// Packed codes (s16.h): block J (0-7) of a group as unsigned bytes u, from
// its nibble vector (block 2i in the low nibbles, 2i + 1 in the high) and
// the group's H high vectors (block J's field of H bits at bit H * (J % (8 /
// H)) of vector J / (8 / H)), moved to bit 4 by an and and an immediate
// shift (J is a template argument; the field never leaves its byte).
template <int H, int J>  // H: bits - 4
inline __m256i packed_block(__m256i nibbles, const __m256i* high) {
  __m256i u = _mm256_and_si256(J % 2 ? _mm256_srli_epi16(nibbles, 4) : nibbles, _mm256_set1_epi8(0x0F));
  if constexpr (H > 0) {
    constexpr int per = 8 / H, at = H * (J % per);
    const __m256i field = _mm256_and_si256(high[J / per], _mm256_set1_epi8(char(((1 << H) - 1) << at)));
    if constexpr (at <= 4) u = _mm256_or_si256(u, _mm256_slli_epi16(field, 4 - at));
    else u = _mm256_or_si256(u, _mm256_srli_epi16(field, at - 4));
  }
  return u;
}

// f(std::integral_constant<int, J>) for J = 0 .. 7, unrolled.
template <class F, int... J>
inline void each_block(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}

template <int H>
void unpack_rows(const uint8_t* packed, int64_t K, int bias, int64_t rows, int8_t* out) {
  const __m256i vbias = _mm256_set1_epi8(char(bias));
  const auto* src = reinterpret_cast<const __m256i*>(packed);
  for (int64_t g = 0; g < rows * (K / kS16PackedGroup); ++g, src += 4 + H) {
    __m256i high[H > 0 ? H : 1];  // the group's high-bit vectors
    for (int v = 0; v < H; ++v) high[v] = _mm256_loadu_si256(src + 4 + v);
    auto* dst = reinterpret_cast<__m256i*>(out + g * kS16PackedGroup);
    each_block([&](auto j) {
      const __m256i u = packed_block<H, decltype(j)::value>(_mm256_loadu_si256(src + j / 2), high);
      _mm256_storeu_si256(dst + j, _mm256_sub_epi8(u, vbias));
    }, std::make_integer_sequence<int, 8>());
  }
}


// hsum8 of the offsets' eight chains (s16.h) t of weight row m (its nh
// per-half offsets) with a row of half sums xs, whose halves from g on
// (past whole vectors) are still to be added lane by lane.
inline float chains_total(__m256 t, const float* m, const float* xs, int64_t g, int64_t nh) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, t);
  for (; g < nh; ++g)
    lanes[g % kLanes] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(m[g]), _mm_set_ss(xs[g]), _mm_set_ss(lanes[g % kLanes])));
  return hsum8(lanes);
}

// The offsets' sums of weight row m with R rows of half sums xs (xs_stride
// apart): half g in lane g % 8, 8 halves a vector fma.
template <int R>
inline void offset_sums(const float* m, const float* xs, int64_t xs_stride, int64_t nh, float out[R]) {
  __m256 t[R];
  for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + kLanes <= nh; g += kLanes) {
    const __m256 mv = _mm256_loadu_ps(m + g);
    for (int r = 0; r < R; ++r) t[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * xs_stride + g), t[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = chains_total(t[r], m, xs + r * xs_stride, g, nh);
}

// ---- Prompt rows: the pair panel ----

constexpr int kPairTileRows = 4;  // x rows per pair tile
constexpr int kPairTileCols = 2;  // columns (of 8 weight rows) per pair tile
// The pair slots of each half (s16.h's pair order: slot p holds lane
// kS16PairLanes[p % 8]; lanes 0-3 are the first 16 elements).
constexpr int kHalfSlots[2][8] = {{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}};

struct PairPanel {
  AlignedVector<uint8_t> codes;  // [block][slot][column][row][2] int16
  AlignedVector<float> d;        // [half][kPanel]
  AlignedVector<float> offsets;  // [x row][kPanel]: the offsets' sums (chunk_offsets)
};

// An empty asm that takes v in a register: the compiler may not reassociate
// a chain of adds across it (GCC otherwise computes every product of a half
// first and spills them).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// A half's exact sums for J columns of 8 weight rows (column slots at w)
// by R x rows (their block's pairs at x[r]): its 8 slots, unrolled so each
// address is a constant offset.
template <int R, int J, int H>
__attribute__((always_inline)) inline void half_pair_sums(const uint8_t* w, const int16_t* const x[R], __m256i isum[R][J]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) isum[r][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const int slot = kHalfSlots[H][i];
    __m256i wv[J];
    for (int j = 0; j < J; ++j) wv[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + (slot * kCols + j) * 32));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + 2 * slot, sizeof pair);
      const __m256i xb = _mm256_set1_epi32(pair);
      for (int j = 0; j < J; ++j) {
        isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_madd_epi16(wv[j], xb));
        keep_in_register(isum[r][j]);
      }
    }
  }
}

// The offsets' sums (s16.h) of every x row by weight rows [n0, n1) into
// t[r * kPanel + n - n0]: 2 x rows by 4 weight rows at a time, so 8 sets of
// eight chains are in flight (one set alone waits on its fmas' latency:
// 0.8x at 128 rows).
void chunk_offsets(const S16Args& s, int64_t n0, int64_t n1, float* t) {
  const LinearArgs& a = *s.a;
  const int64_t nh = a.K / kS16Half;
  int64_t r = 0;
  for (; r + 2 <= a.M; r += 2) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      __m256 v[4][2];
      for (int o = 0; o < 4; ++o) v[o][0] = v[o][1] = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + kLanes <= nh; g += kLanes) {
        const __m256 x0 = _mm256_loadu_ps(s.xs + r * nh + g), x1 = _mm256_loadu_ps(s.xs + (r + 1) * nh + g);
        for (int o = 0; o < 4; ++o) {
          const __m256 mv = _mm256_loadu_ps(a.m + (n + o) * nh + g);
          v[o][0] = _mm256_fmadd_ps(mv, x0, v[o][0]);
          v[o][1] = _mm256_fmadd_ps(mv, x1, v[o][1]);
        }
      }
      for (int o = 0; o < 4; ++o)
        for (int i = 0; i < 2; ++i)
          t[(r + i) * kPanel + n + o - n0] = chains_total(v[o][i], a.m + (n + o) * nh, s.xs + (r + i) * nh, g, nh);
    }
    for (; n < n1; ++n) {
      float sums[2];
      offset_sums<2>(a.m + n * nh, s.xs + r * nh, nh, nh, sums);
      t[r * kPanel + n - n0] = sums[0];
      t[(r + 1) * kPanel + n - n0] = sums[1];
    }
  }
  for (; r < a.M; ++r)
    for (int64_t n = n0; n < n1; ++n) offset_sums<1>(a.m + n * nh, s.xs + r * nh, nh, nh, t + r * kPanel + n - n0);
}

// out[r0 .. r0+R, the valid rows of columns c0 .. c0+J]: per block and
// half, the half's 8 slots by x's pairs (exact int32), then its chain's
// step; with offsets, chunk_offsets' sums added.
template <int R, int J, bool HasM>
void pair_tile(const S16Args& s, const PairPanel& p, int64_t r0, int64_t n0, int c0, const int valid[kCols]) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock;
  __m256 e[R][J][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) e[r][j][0] = e[r][j][1] = _mm256_setzero_ps();
  const auto step = [&](int h, int64_t b, __m256i isum[R][J]) __attribute__((always_inline)) {
    const int64_t g = 2 * b + h;
    for (int j = 0; j < J; ++j) {
      const int64_t at = g * kPanel + (c0 + j) * kLanes;
      const __m256 d = _mm256_load_ps(p.d.data() + at);
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ss(a.x8_scale + (r0 + r) * nb + b));
        e[r][j][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum[r][j]), e[r][j][h]);
      }
    }
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = p.codes.data() + b * kPairBlockBytes + c0 * 32;
    const int16_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = s.c16 + (r0 + r) * K + b * kBlock;
    __m256i isum[R][J];
    half_pair_sums<R, J, 0>(w, x, isum);
    step(0, b, isum);
    half_pair_sums<R, J, 1>(w, x, isum);
    step(1, b, isum);
  }
  for (int j = 0; j < J; ++j) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid[c0 + j]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; ++r) {
      __m256 out = _mm256_add_ps(e[r][j][0], e[r][j][1]);
      if constexpr (HasM) out = _mm256_add_ps(out, _mm256_load_ps(p.offsets.data() + (r0 + r) * kPanel + (c0 + j) * kLanes));
      _mm256_maskstore_ps(a.out + (r0 + r) * a.N + n0 + (c0 + j) * kLanes, mask, out);
    }
  }
}

using PairTileFn = void (*)(const S16Args&, const PairPanel&, int64_t r0, int64_t n0, int c0, const int valid[kCols]);
template <bool HasM, int... R>
constexpr std::array<PairTileFn, sizeof...(R)> pair_tile_table(std::integer_sequence<int, R...>) {
  return {&pair_tile<R + 1, kPairTileCols, HasM>...};
}

// Rows [n0, n1) (at most one panel) for every x row.
void panel_rows(const S16Args& s, int64_t n0, int64_t n1) {
  static constexpr auto plain = pair_tile_table<false>(std::make_integer_sequence<int, kPairTileRows>());
  static constexpr auto offset = pair_tile_table<true>(std::make_integer_sequence<int, kPairTileRows>());
  static thread_local PairPanel p;
  const LinearArgs& a = *s.a;
  const int64_t nb = a.K / kBlock, nh = a.K / kS16Half;
  p.codes.resize(size_t(nb * kPairBlockBytes));
  p.d.resize(size_t(nh * kPanel));
  const auto& tiles = a.m ? offset : plain;
  int valid[kCols];
  for (int c = 0; c < kCols; ++c) {
    valid[c] = int(std::clamp<int64_t>(n1 - n0 - c * kLanes, 0, kLanes));
    byte_pair_column(reinterpret_cast<const uint8_t*>(s.row_codes(n0 + c * kLanes)), a.K, valid[c], nb,
                     p.codes.data() + c * 32);
    transpose_scales(a.d, nh, n0 + c * kLanes, valid[c], c, p.d.data());
  }
  if (a.m) {
    p.offsets.resize(size_t(a.M * kPanel));
    chunk_offsets(s, n0, n1, p.offsets.data());
  }
  // x rows in tiles of as even a size as kPairTileRows allows (9 rows: 3 x 3, not 4 + 4 + 1)
  const int64_t count = (a.M + kPairTileRows - 1) / kPairTileRows;
  for (int64_t t = 0, r0 = 0; t < count; ++t) {
    const int64_t rows = a.M / count + (t < a.M % count);
    for (int c = 0; c < kCols && valid[c]; c += kPairTileCols)  // columns past the weight: zeros, not stored
      tiles[size_t(rows - 1)](s, p, r0, n0, c, valid);
    r0 += rows;
  }
}

// ---- Few rows: 4 outputs' lane sums reduced together ----

constexpr int kUnit = 4;  // outputs whose half sums one vector holds

// [first-half sums of outputs 0-3 | second-half sums of outputs 0-3] from
// their 8 lane sums each (lanes 0-3: the first 16 elements); exact.
inline __m256i unit_halves(const __m256i v[kUnit]) {
  const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
  const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

// A unit's scales of 4 consecutive blocks from halves g ..
// g + 7 of its rows, per block in unit_halves' order [f(o, 2b) | f(o, 2b+1)].
inline void quad_values(const float* const row[kUnit], int64_t g, __m256 out[4]) {
  __m256 y[kUnit];
  for (int o = 0; o < kUnit; ++o) y[o] = _mm256_loadu_ps(row[o] + g);
  const auto pick = [](__m256 a, __m256 b, __m256& first, __m256& second) {
    const __m256 x = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
    const __m256 z = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
    first = _mm256_permute2f128_ps(x, z, 0x20);
    second = _mm256_permute2f128_ps(x, z, 0x31);
  };
  // unpacklo: blocks 0 and 2 of the quad; unpackhi: 1 and 3
  pick(_mm256_unpacklo_ps(y[0], y[1]), _mm256_unpacklo_ps(y[2], y[3]), out[0], out[2]);
  pick(_mm256_unpackhi_ps(y[0], y[1]), _mm256_unpackhi_ps(y[2], y[3]), out[1], out[3]);
}

// One block's, for a block outside whole quads.
inline __m256 block_values(const float* const row[kUnit], int64_t g) {
  return _mm256_setr_ps(row[0][g], row[1][g], row[2][g], row[3][g], row[0][g + 1], row[1][g + 1], row[2][g + 1],
                        row[3][g + 1]);
}

inline void prefetch_line(const uint8_t* p) {
  // As an integer: the address may lie past the weight (a prefetch never faults).
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p)), _MM_HINT_T0);
}

// [v[g] x 4 | v[g + 1] x 4] of a per-half row (half_bias, read as floats).
inline __m256 pair_spread(const float* v) {
  double two;
  std::memcpy(&two, v, sizeof two);
  return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_set1_pd(two)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// A weight row's codes, a group of 8 blocks at a time (the packed layout's
// group; bytes alike), and their lane sums with a row of x's codes.
// Bytes: int8 codes as they lie (|w| by x * sign(w): pairs <= 2 * 128 * 127).
struct ByteCodes {
  static constexpr bool kBiased = false;
  static int64_t row_bytes(const LinearArgs& a) { return a.K; }
  static const uint8_t* group(const S16Args& s, int64_t row, int64_t b0) {
    return reinterpret_cast<const uint8_t*>(s.row_codes(row)) + b0 * kBlock;
  }
  template <int J>
  static __m256i block(const uint8_t* g) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g) + J); }
  static __m256i sums(__m256i w, const int8_t* x, __m256i times) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), times);
  }
};
// Packed: u = q + bias read in place (the one high vector block J needs), u
// by x (pairs <= 2 * 63 * 128).
template <int H>
struct PackedCodes {
  static constexpr bool kBiased = true;
  static int64_t row_bytes(const LinearArgs& a) { return a.row_bytes(); }
  static const uint8_t* group(const S16Args& s, int64_t row, int64_t b0) {
    return s.a->qs + row * s.a->row_bytes() + b0 / 8 * s16_packed_group_bytes(4 + H);
  }
  template <int J>
  static __m256i block(const uint8_t* g) {
    const auto* v = reinterpret_cast<const __m256i*>(g);
    constexpr int per = H > 0 ? 8 / H : 8;
    __m256i high[H > 0 ? H : 1];
    if constexpr (H > 0) high[J / per] = _mm256_loadu_si256(v + 4 + J / per);
    return packed_block<H, J>(_mm256_loadu_si256(v + J / 2), high);
  }
  static __m256i sums(__m256i u, const int8_t* x, __m256i times) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), times);
  }
};

// Block J of a group for one unit: its 4 outputs' lane sums with each x
// row reduced to half sums, then each row's chains stepped (dq: the
// block's scales in unit_halves' order).
template <int R, class Codes, int J>
__attribute__((always_inline)) inline void unit_block(const S16Args& s, const uint8_t* const g[kUnit], int64_t b,
                                                      __m256 dq, __m256 acc[R]) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  __m256i w[kUnit];
  for (int o = 0; o < kUnit; ++o) w[o] = Codes::template block<J>(g[o]);
  for (int r = 0; r < R; ++r) {
    __m256i lanes[kUnit];
    for (int o = 0; o < kUnit; ++o) {  // int8x2: the pairs' sums times 256 (vpmaddwd), plus the low term's
      if (a.x8_lo)
        lanes[o] = _mm256_add_epi32(Codes::sums(w[o], a.x8 + r * K + b * kBlock, _mm256_set1_epi16(256)),
                                    Codes::sums(w[o], a.x8_lo + r * K + b * kBlock, _mm256_set1_epi16(1)));
      else
        lanes[o] = Codes::sums(w[o], a.x8 + r * K + b * kBlock, _mm256_set1_epi16(1));
    }
    __m256i isum = unit_halves(lanes);
    if constexpr (Codes::kBiased)
      if (s.half_bias)
        isum = _mm256_sub_epi32(isum, _mm256_castps_si256(pair_spread(reinterpret_cast<const float*>(s.half_bias + r * nh + 2 * b))));
    const __m256 scale = _mm256_mul_ps(dq, _mm256_broadcast_ss(a.x8_scale + r * nb + b));
    acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[r]);
  }
}

// One unit: outputs n .. n + count (rows past count repeat the last; only
// count are stored) by R x rows, blocks by groups of 8 (bytes: then the
// rest one by one), then the offsets.
template <int R, class Codes>
void few_rows_unit(const S16Args& s, int64_t n, int count) {
  const LinearArgs& a = *s.a;
  const int64_t nb = a.K / kBlock, nh = a.K / kS16Half;
  int64_t rows[kUnit];
  const float* d[kUnit];
  for (int o = 0; o < kUnit; ++o) {
    rows[o] = n + std::min(o, count - 1);
    d[o] = a.d + rows[o] * nh;
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  // The next unit's codes and scales follow this unit's in memory, but a
  // unit reads its 4 rows side by side: 4 short streams the hardware
  // prefetchers would start cold at every unit. Each group asks for its
  // share of the next unit's lines instead.
  const uint8_t* next_codes = Codes::group(s, n + kUnit, 0);
  const auto* next_d = reinterpret_cast<const uint8_t*>(a.d + (n + kUnit) * nh);
  const auto* next_m = a.m ? reinterpret_cast<const uint8_t*>(a.m + (n + kUnit) * nh) : nullptr;
  const int64_t groups = std::max<int64_t>(1, nb / 8);
  const int64_t code_lines = (kUnit * Codes::row_bytes(a) + 63) / 64, d_lines = (kUnit * nh * 4 + 63) / 64;
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const uint8_t* g[kUnit];
    for (int o = 0; o < kUnit; ++o) g[o] = Codes::group(s, rows[o], b0);
    const int64_t gi = b0 / 8;
    for (int64_t l = gi * code_lines / groups; l < (gi + 1) * code_lines / groups; ++l) prefetch_line(next_codes + 64 * l);
    for (int64_t l = gi * d_lines / groups; l < (gi + 1) * d_lines / groups; ++l) {
      prefetch_line(next_d + 64 * l);
      if (next_m) prefetch_line(next_m + 64 * l);
    }
    __m256 dq[8];  // quads of blocks: their scales transposed at once
    quad_values(d, 2 * b0, dq);
    quad_values(d, 2 * b0 + 8, dq + 4);
    unit_block<R, Codes, 0>(s, g, b0, dq[0], acc);
    unit_block<R, Codes, 1>(s, g, b0 + 1, dq[1], acc);
    unit_block<R, Codes, 2>(s, g, b0 + 2, dq[2], acc);
    unit_block<R, Codes, 3>(s, g, b0 + 3, dq[3], acc);
    unit_block<R, Codes, 4>(s, g, b0 + 4, dq[4], acc);
    unit_block<R, Codes, 5>(s, g, b0 + 5, dq[5], acc);
    unit_block<R, Codes, 6>(s, g, b0 + 6, dq[6], acc);
    unit_block<R, Codes, 7>(s, g, b0 + 7, dq[7], acc);
  }
  if constexpr (!Codes::kBiased) {  // bytes: K is a multiple of 32 only
    for (; b0 < nb; ++b0) {
      const uint8_t* g[kUnit];
      for (int o = 0; o < kUnit; ++o) g[o] = Codes::group(s, rows[o], b0);
      unit_block<R, Codes, 0>(s, g, b0, block_values(d, 2 * b0), acc);
    }
  }
  alignas(16) float t[kUnit][R] = {};  // the offsets, output by output
  if (a.m)
    for (int o = 0; o < count; ++o) offset_sums<R>(a.m + rows[o] * nh, s.xs, nh, nh, t[o]);
  for (int r = 0; r < R; ++r) {
    const __m128 out = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    alignas(16) float v[kUnit];
    _mm_store_ps(v, out);
    for (int o = 0; o < count; ++o) a.out[r * a.N + n + o] = a.m ? v[o] + t[o][r] : v[o];
  }
}

template <int R, class Codes>
void few_rows(const S16Args& s, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kUnit) few_rows_unit<R, Codes>(s, n, int(std::min<int64_t>(kUnit, n1 - n)));
}

template <int R>
void few_rows_any(const S16Args& s, int64_t n0, int64_t n1) {
  switch (s.a->code_bits) {
    case 4: return few_rows<R, PackedCodes<0>>(s, n0, n1);
    case 5: return few_rows<R, PackedCodes<1>>(s, n0, n1);
    case 6: return few_rows<R, PackedCodes<2>>(s, n0, n1);
    default: return few_rows<R, ByteCodes>(s, n0, n1);
  }
}

using FewRowsFn = void (*)(const S16Args&, int64_t n0, int64_t n1);
template <int... R>
constexpr std::array<FewRowsFn, sizeof...(R)> few_rows_table(std::integer_sequence<int, R...>) {
  return {&few_rows_any<R + 1>...};
}

}  // namespace

// Few rows: few_rows on the codes as they lie. Else one pair panel per work
// item (at most kI8ChunkRows rows: the driver's chunks), swept by tiles.
void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  static constexpr auto few = few_rows_table(std::make_integer_sequence<int, int(kFewRows)>());
  if (s.a->M <= kFewRows) return few[size_t(s.a->M - 1)](s, n0, n1);
  for (int64_t n = n0; n < n1; n += kPanel) panel_rows(s, n, std::min(n1, n + kPanel));
}

void s16_unpack(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out) {
  switch (bits) {
    case 4: return unpack_rows<0>(packed, K, bias, rows, out);
    case 5: return unpack_rows<1>(packed, K, bias, rows, out);
    default: return unpack_rows<2>(packed, K, bias, rows, out);
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
