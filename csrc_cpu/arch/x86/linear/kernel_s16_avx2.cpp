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
    case 1: return few_rows<1>(s, n0, n1);
    case 2: return few_rows<2>(s, n0, n1);
    case 3: return few_rows<3>(s, n0, n1);
    default: break;
  }
  for (int64_t r = 0; r < M; r += kTileRows) tiles[size_t(std::min<int64_t>(kTileRows, M - r) - 1)](s, r, n0, n1);
}

// Packed codes (s16.h) into int8, a block at a time: the nibbles split into
// elements 0-15 | 16-31, each plane's 32 bits spread to a byte per element
// (each byte of the plane copied to eight, tested against its bit), OR-ed
// in at bit 4 + p, then the bias subtracted: the bytes unpack_s16_rows makes.
void s16_unpack(const uint8_t* packed, int64_t K, int bits, int bias, int64_t rows, int8_t* out) {
  const int64_t block_bytes = s16_packed_block_bytes(bits), blocks = rows * (K / kBlock);
  const __m256i low = _mm256_set1_epi8(0x0F), spread = _mm256_setr_epi8(
      0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), vbias = _mm256_set1_epi8(char(bias));
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* src = packed + i * block_bytes;
    const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), low);
    for (int p = 0; p < bits - 4; ++p) {
      int32_t plane;
      std::memcpy(&plane, src + 16 + 4 * p, sizeof plane);
      const __m256i set = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(plane), spread), bit);
      u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(set, bit), _mm256_set1_epi8(char(16 << p))));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kBlock), _mm256_sub_epi8(u, vbias));
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
