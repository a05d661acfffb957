// AVX2 build of the s16 layout's kernel (s16.h), shared by every x86 build
// past scalar. x's codes come as int16 in the pair order (S16Args::c16), so
// one weight block, widened once (two vpmovsxbw, two vshufps), serves every
// x row of a register tile: its eight exact int32 lane sums are
// madd(wA, cA) + madd(wB, cB) for int8 and int8x2 alike (|w * c| <= 128 *
// 32639, a lane's four products < 2^24). Then per lane, as the scalar
// definition: convert, fl(d * dx), one fma. Tiles of kTileRows x rows by
// kTileCols weight rows keep their accumulators in registers; a lane's chain
// is the definition's whatever tile it falls in, so a row's bits never
// depend on the rows beside it. Calls of up to kFewRows rows (decode) keep
// the weight's bytes as they lie (few_rows_tile): with so few rows to reuse
// it, widening a block costs more than it saves.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "arch/target.h"
#include "linear/s16.h"

PAGED_TARGET_BEGIN("avx2,fma")

namespace paged::cpu::linear::isa_avx2 {
namespace {

constexpr int kTileRows = 3;  // x rows per register tile
constexpr int kTileCols = 2;  // weight rows per register tile
constexpr int64_t kFewRows = kS16FewRows;  // calls of up to this many rows take few_rows (no c16)

// One weight row's block, widened: the pairs A and B in c16's order and the
// scales of the lanes there, [d0 d0 d1 d1 | d0 d0 d1 d1] (kS16PairLanes).
struct WeightBlock {
  __m256i a, b;
  __m256 d;
};

inline WeightBlock weight_block(const int8_t* w, const float* d) {
  // dwords of lo: pairs A, B of lanes 0, 1 | 2, 3; of hi: lanes 4, 5 | 6, 7
  const __m256 lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m256 hi =
      _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  double pair;
  std::memcpy(&pair, d, sizeof pair);  // d[2b], d[2b + 1]
  const __m256 ds = _mm256_castpd_ps(_mm256_set1_pd(pair));
  return {_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0))),
          _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))), _mm256_unpacklo_ps(ds, ds)};
}

// hsum8 (quant_linear.h) of lanes held in kS16PairLanes' positions:
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), each add as the definition's.
inline float lanes_sum(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));  // l0+l4, l1+l5 | l2+l6, l3+l7
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// hsum8 of lanes in their natural positions.
inline float natural_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4, l1+l5, l2+l6, l3+l7
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// The eight offset chains (s16.h) of the tile's outputs: half h in lane
// h % 8, so 8 halves are one vector fma; t[i][j] summed as hsum8.
template <int R, int J>
void offsets(const S16Args& s, int64_t r0, int64_t n0, float t[R][J]) {
  const LinearArgs& a = *s.a;
  const int64_t nh = a.K / kS16Half;
  __m256 tv[R][J];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) tv[i][j] = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + kLanes <= nh; h += kLanes) {
    __m256 m[J];
    for (int j = 0; j < J; ++j) m[j] = _mm256_loadu_ps(a.m + (n0 + j) * nh + h);
    for (int i = 0; i < R; ++i) {
      const __m256 xs = _mm256_loadu_ps(s.xs + (r0 + i) * nh + h);
      for (int j = 0; j < J; ++j) tv[i][j] = _mm256_fmadd_ps(m[j], xs, tv[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) {
      if (h == nh) {
        t[i][j] = natural_sum(tv[i][j]);
        continue;
      }
      alignas(32) float lanes[kLanes];
      _mm256_store_ps(lanes, tv[i][j]);
      for (int64_t g = h; g < nh; ++g)
        lanes[g % kLanes] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a.m[(n0 + j) * nh + g]),
                                                       _mm_set_ss(s.xs[(r0 + i) * nh + g]), _mm_set_ss(lanes[g % kLanes])));
      t[i][j] = hsum8(lanes);
    }
}

// out[r0 .. r0+R, n0 .. n0+J].
template <int R, int J>
void tile(const S16Args& s, int64_t r0, int64_t n0) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  const int16_t* c = s.c16 + r0 * K;
  const float* dx = a.x8_scale + r0 * nb;
  __m256 acc[R][J];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    WeightBlock w[J];
    for (int j = 0; j < J; ++j) w[j] = weight_block(s.row_codes(n0 + j) + b * kBlock, a.d + (n0 + j) * nh + 2 * b);
    for (int i = 0; i < R; ++i) {
      const auto* x = reinterpret_cast<const __m256i*>(c + i * K + b * kBlock);
      const __m256i xa = _mm256_loadu_si256(x), xb = _mm256_loadu_si256(x + 1);
      const __m256 dxv = _mm256_broadcast_ss(dx + i * nb + b);
      for (int j = 0; j < J; ++j) {
        const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(w[j].a, xa), _mm256_madd_epi16(w[j].b, xb));
        acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(w[j].d, dxv), _mm256_cvtepi32_ps(isum), acc[i][j]);
      }
    }
  }
  float t[R][J];
  if (a.m) offsets<R, J>(s, r0, n0, t);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) {
      const float out = lanes_sum(acc[i][j]);
      a.out[(r0 + i) * a.N + n0 + j] = a.m ? out + t[i][j] : out;
    }
}

template <int R>
void tile_cols(const S16Args& s, int64_t r0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileCols <= n1; n += kTileCols) tile<R, kTileCols>(s, r0, n);
  for (; n < n1; ++n) tile<R, 1>(s, r0, n);
}

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

// Calls of few rows: one weight row by up to kFewRows x rows, its block's
// eight lane sums from vpmaddubsw on |w| and x * sign(w) (vpabsb,
// vpsignb: pairs <= 2 * 128 * 127 < 2^15) and vpmaddwd by ones on the int8
// codes as they lie; widening the weight to int16 pairs does not pay with
// so few rows to reuse it.
inline __m256i byte_lane_sums(__m256i wabs, __m256i w, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}

template <int R>
void few_rows_tile(const S16Args& s, int64_t n) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  const int8_t* w = s.row_codes(n);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i wabs = _mm256_abs_epi8(wv);
    const float d0 = a.d[n * nh + 2 * b], d1 = a.d[n * nh + 2 * b + 1];
    for (int i = 0; i < R; ++i) {
      const float dx = a.x8_scale[i * nb + b];
      __m256i isum = byte_lane_sums(wabs, wv, a.x8 + i * K + b * kBlock);
      if (a.x8_lo)
        isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 8), byte_lane_sums(wabs, wv, a.x8_lo + i * K + b * kBlock));
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(d1 * dx), _mm_set1_ps(d0 * dx));
      acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[i]);
    }
  }
  float t[R][1];
  if (a.m) offsets<R, 1>(s, 0, n, t);
  for (int i = 0; i < R; ++i) {
    const float out = natural_sum(acc[i]);
    a.out[i * a.N + n] = a.m ? out + t[i][0] : out;
  }
}

template <int R>
void few_rows(const S16Args& s, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) few_rows_tile<R>(s, n);
}

// Few rows on packed codes, read as they lie: a block's unsigned u by x's
// codes (vpmaddubsw: pairs <= 2 * 63 * 128 < 2^15), then bias times the
// lanes' sums of x (xbias, per row and block) subtracted: sum (u - bias) c,
// the lane sums few_rows_tile makes from the int8 codes, exactly. The
// scales fl(d * dx) of a group's eight blocks come from two vector
// multiplies (the same products), one permute per block picks its pair.
template <int R, int H, bool TwoTerms, bool Bias>
void few_rows_packed_tile(const S16Args& s, int64_t n, const int32_t* xbias) {
  const LinearArgs& a = *s.a;
  const int64_t K = a.K, nb = K / kBlock, nh = K / kS16Half;
  const auto* src = reinterpret_cast<const __m256i*>(a.qs + n * a.row_bytes());
  const __m256i ones = _mm256_set1_epi16(1), c256 = _mm256_set1_epi16(256);
  const __m256i dup_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8, src += 4 + H) {
    __m256i high[H > 0 ? H : 1];  // the group's high-bit vectors
    for (int v = 0; v < H; ++v) high[v] = _mm256_loadu_si256(src + 4 + v);
    // sc[i][v]: d[2b] * dx[b], d[2b + 1] * dx[b] for blocks b0 + 4v .. b0 + 4v + 3
    const __m256 d_lo = _mm256_loadu_ps(a.d + n * nh + 2 * b0), d_hi = _mm256_loadu_ps(a.d + n * nh + 2 * b0 + 8);
    __m256 sc[R][2];
    for (int i = 0; i < R; ++i) {
      const __m256 dx = _mm256_loadu_ps(a.x8_scale + i * nb + b0);
      sc[i][0] = _mm256_mul_ps(d_lo, _mm256_permutevar8x32_ps(dx, dup_lo));
      sc[i][1] = _mm256_mul_ps(d_hi, _mm256_permutevar8x32_ps(dx, dup_hi));
    }
    each_block([&](auto j) {
      constexpr int J = decltype(j)::value;
      const int64_t b = b0 + J;
      const __m256i u = packed_block<H, J>(_mm256_loadu_si256(src + J / 2), high);
      const __m256i pick = _mm256_setr_epi32(2 * (J % 4), 2 * (J % 4), 2 * (J % 4), 2 * (J % 4), 2 * (J % 4) + 1,
                                             2 * (J % 4) + 1, 2 * (J % 4) + 1, 2 * (J % 4) + 1);
      for (int i = 0; i < R; ++i) {
        const auto* x = reinterpret_cast<const __m256i*>(a.x8 + i * K + b * kBlock);
        __m256i isum;
        if constexpr (TwoTerms) {
          const auto* lo = reinterpret_cast<const __m256i*>(a.x8_lo + i * K + b * kBlock);
          isum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256(x)), c256),
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256(lo)), ones));
        } else {
          isum = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256(x)), ones);
        }
        if constexpr (Bias)
          isum = _mm256_sub_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xbias + (i * nb + b) * kLanes)));
        const __m256 scale = _mm256_permutevar8x32_ps(sc[i][J / 4], pick);
        acc[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[i]);
      }
    }, std::make_integer_sequence<int, 8>());
  }
  float t[R][1];
  if (a.m) offsets<R, 1>(s, 0, n, t);
  for (int i = 0; i < R; ++i) {
    const float out = natural_sum(acc[i]);
    a.out[i * a.N + n] = a.m ? out + t[i][0] : out;
  }
}

// xbias [M, nb, 8]: bias * the lane sums of each row's codes c (xq, or 256 xq + lo).
void lane_bias(const LinearArgs& a, int32_t* xbias) {
  const int64_t K = a.K, nb = K / kBlock;
  const __m256i ones8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi32(a.code_bias);
  for (int64_t i = 0; i < a.M; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      auto lanes = [&](const int8_t* x) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * K + b * kBlock));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones);
      };
      __m256i sum = lanes(a.x8);
      if (a.x8_lo) sum = _mm256_add_epi32(_mm256_slli_epi32(sum, 8), lanes(a.x8_lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xbias + (i * nb + b) * kLanes), _mm256_mullo_epi32(sum, bias));
    }
}

template <int R, int H>
void few_rows_packed(const S16Args& s, int64_t n0, int64_t n1) {
  static thread_local std::vector<int32_t> xbias;
  const LinearArgs& a = *s.a;
  if (a.code_bias) {
    xbias.resize(size_t(a.M * a.blocks() * kLanes));
    lane_bias(a, xbias.data());
  }
  const auto tile = a.x8_lo ? (a.code_bias ? few_rows_packed_tile<R, H, true, true> : few_rows_packed_tile<R, H, true, false>)
                            : (a.code_bias ? few_rows_packed_tile<R, H, false, true> : few_rows_packed_tile<R, H, false, false>);
  for (int64_t n = n0; n < n1; ++n) tile(s, n, xbias.data());
}

template <int R>
void few_rows_any(const S16Args& s, int64_t n0, int64_t n1) {
  switch (s.a->code_bits) {
    case 4: return few_rows_packed<R, 0>(s, n0, n1);
    case 5: return few_rows_packed<R, 1>(s, n0, n1);
    case 6: return few_rows_packed<R, 2>(s, n0, n1);
    default: return few_rows<R>(s, n0, n1);
  }
}

using TileFn = void (*)(const S16Args&, int64_t r0, int64_t n0, int64_t n1);
template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&tile_cols<R + 1>...};
}

}  // namespace

// Few rows: few_rows. Else tiles of x rows outside, the chunk's weight rows
// inside: a tile's codes stay in L1 while the chunk's rows (kI8ChunkRows x K
// bytes) sit in L2.
void s16_rows(const S16Args& s, int64_t n0, int64_t n1) {
  static constexpr auto tiles = tile_table(std::make_integer_sequence<int, kTileRows>());
  const int64_t M = s.a->M;
  static_assert(kFewRows == 3, "the switch below covers 1 .. kFewRows rows");
  switch (M) {
    case 1: return few_rows_any<1>(s, n0, n1);
    case 2: return few_rows_any<2>(s, n0, n1);
    case 3: return few_rows_any<3>(s, n0, n1);
    default: break;
  }
  for (int64_t r = 0; r < M; r += kTileRows) tiles[size_t(std::min<int64_t>(kTileRows, M - r) - 1)](s, r, n0, n1);
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
