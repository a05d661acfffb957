// AVX2 build of the s16 layout's kernel (s16.h), shared by the x86 builds
// past scalar but avx512 and amx (kernel_s16_avx512.cpp); bitwise the scalar
// definition. Its 256-bit pieces live in s16_ymm.inc, which the AVX-512
// build includes too. Two paths by the call's rows:
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
#include "linear/compact_scales.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")

namespace paged::cpu::linear::isa_avx2 {
namespace {

#include "arch/x86/linear/ymm_panel.inc"

// Sums of 4 products of unsigned bytes u by signed bytes x per int32 lane
// (no pair saturates: u <= 128 and |x| <= 127 for bytes with signs moved,
// u <= 63 for packed codes).
inline __m256i dot4(__m256i u, __m256i x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)); }
// int8x2: the high term's pair sums times 256 (vpmaddwd), plus the low term's.
inline __m256i dot4x2(__m256i u, __m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, hi), _mm256_set1_epi16(256)), dot4(u, lo));
}

#include "arch/x86/linear/s16_ymm.inc"

template <int Bits>
void unpack_rows(const uint8_t* packed, int64_t K, int bias, int64_t rows, int8_t* out) {
  const __m256i vbias = _mm256_set1_epi8(char(bias));
  const auto* src = reinterpret_cast<const __m256i*>(packed);
  for (int64_t g = 0; g < rows * (K / kS16PackedGroup); ++g, src += Bits) {
    auto* dst = reinterpret_cast<__m256i*>(out + g * kS16PackedGroup);
    each_block([&](auto j) { _mm256_storeu_si256(dst + j, _mm256_sub_epi8(packed_block<Bits, decltype(j)::value>(src), vbias)); },
               std::make_integer_sequence<int, 8>());
  }
}

// ---- Prompt rows: 8 weight rows per vector ----

constexpr int kPairTileRows = 4;  // x rows per pair tile
constexpr int kPairTileCols = 2;  // columns (of 8 weight rows) per pair tile
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

template <bool HasM, int... R>
constexpr std::array<PairTileFn, sizeof...(R)> pair_tile_table(std::integer_sequence<int, R...>) {
  return {&pair_tile<R + 1, kPairTileCols, HasM>...};
}

}  // namespace

void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  static constexpr auto plain = pair_tile_table<false>(std::make_integer_sequence<int, kPairTileRows>());
  static constexpr auto offset = pair_tile_table<true>(std::make_integer_sequence<int, kPairTileRows>());
  rows_with_tiles(s, n0, n1, plain, offset, kPairTileCols);
}

void s16_unpack(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out) {
  switch (bits) {
    case 2: return unpack_rows<2>(packed, K, bias, rows, out);
    case 3: return unpack_rows<3>(packed, K, bias, rows, out);
    case 4: return unpack_rows<4>(packed, K, bias, rows, out);
    case 5: return unpack_rows<5>(packed, K, bias, rows, out);
    default: return unpack_rows<6>(packed, K, bias, rows, out);
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
