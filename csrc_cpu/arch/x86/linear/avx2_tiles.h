// What the AVX2 + FMA builds of both quantized-linear paths share: sources of
// a block's codes (int16 or fp32 vectors), software prefetch, Q4_1's offset
// sums, and register tiles of outputs (x rows x weight rows) that keep the
// per-output order of quant_linear.h whatever the tile shape. A path supplies
// the block arithmetic as a policy:
//   struct Path {
//     struct Codes { V v[n]; };        // a block's codes in registers, as Src::load(b, v) fills them
//     struct Row {                     // one x row's state
//       Row(const LinearArgs&, int64_t r);
//       void begin_block(int64_t b);   // per-block broadcasts
//       __m256 dot(const Codes&, int64_t b) const;  // t of the block, 8 lanes
//     };
//   };
// Only included by the AVX2 kernel files; its own target region (arch/target.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "arch/target.h"
#include "linear/quant_linear.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")
namespace paged::cpu::linear::isa_avx2 {
namespace tiles {

// Direct passes: all M <= kDirectMaxRows x rows by kDirectOutputs / M weight
// rows, so the accumulators stay within the 16 ymm (a 4 x 4 tile spills).
constexpr int kDirectOutputs = 8;

// Packed rows stream from DRAM at M = 1 (the model's weights do not fit in
// L3); asking for the bytes this far ahead keeps more misses in flight.
constexpr int64_t kPrefetchBytes = 3072;
inline void prefetch_ahead(const uint8_t* p) {
  // As an integer: the address may lie past the weight (a prefetch never faults).
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes), _MM_HINT_T0);
}

// Sources of a block's codes from the packed row: as two int16 vectors
// (elements 0-15, 16-31) or four fp32 vectors (0-7, 8-15, 16-23, 24-31).
template <bool kMinus8>
struct Nibbles {  // Q4_0 (codes q - 8) / Q4_1 (codes q); byte j holds elements j (low) and 16 + j (high)
  const uint8_t* row;
  void prefetch(int64_t b) const { prefetch_ahead(row + b * (kBlock / 2)); }
  void load(int64_t b, __m256i q[2]) const {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2))));
    q[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(bytes, 4);
    if constexpr (kMinus8) {
      q[0] = _mm256_sub_epi16(q[0], _mm256_set1_epi16(8));
      q[1] = _mm256_sub_epi16(q[1], _mm256_set1_epi16(8));
    }
  }
  // Bytes 0-7 / 8-15 zero-extended to 32-bit lanes: low nibbles are elements
  // 0-7 / 8-15, high nibbles (a plain shift) 16-23 / 24-31.
  void load(int64_t b, __m256 q[4]) const {
    const uint8_t* p = row + b * (kBlock / 2);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256i codes[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask), _mm256_srli_epi32(first, 4),
                        _mm256_srli_epi32(second, 4)};
    for (int i = 0; i < 4; ++i) {
      if constexpr (kMinus8) codes[i] = _mm256_sub_epi32(codes[i], _mm256_set1_epi32(8));
      q[i] = _mm256_cvtepi32_ps(codes[i]);
    }
  }
};

struct Bytes {  // Q8_0
  const uint8_t* row;
  void prefetch(int64_t b) const { prefetch_ahead(row + b * kBlock); }
  void load(int64_t b, __m256i q[2]) const {
    const uint8_t* p = row + b * kBlock;
    q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  void load(int64_t b, __m256 q[4]) const {
    const uint8_t* p = row + b * kBlock;
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};

inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// Q4_1's offset sums sm[r, n] = sum_b m[n, b] * xs[b, r] (one fma chain per
// output, in block order) of weight rows n0 .. n1 for every x row, written
// into out: 8 x rows per vector, then the rest with the chains of all weight
// rows interleaved, so no loop waits on one fma's latency.
inline void offset_sums_into_out(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.blocks(), M = a.M, N = a.N;
  int64_t r = 0;
  for (; r + 8 <= M; r += 8)
    for (int64_t n = n0; n < n1; ++n) {
      const float* m = a.m + n * nb;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b)
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(m + b), _mm256_loadu_ps(a.xs + b * M + r), acc);
      float lanes[kLanes];
      _mm256_storeu_ps(lanes, acc);
      for (int l = 0; l < kLanes; ++l) a.out[(r + l) * N + n] = lanes[l];
    }
  for (; r < M; ++r) {
    float* sm = a.out + r * N;
    std::fill(sm + n0, sm + n1, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const float xs = a.xs[b * M + r];
      for (int64_t n = n0; n < n1; ++n) sm[n] = __builtin_fmaf(a.m[n * nb + b], xs, sm[n]);
    }
  }
}

// out[r0 .. r0+R, n0 .. n0+C] with the codes of weight row n0 + c from
// src[c]; a block's x loads and scales are shared by the C weight rows, its
// codes by the R x rows. With `add_out`, out already holds Q4_1's offset sums.
template <class Path, class Src, int R, int C>
void tile(const LinearArgs& a, const Src* src, int64_t n0, int64_t r0, bool add_out) {
  const int64_t nb = a.blocks();
  const float* d[C];
  for (int c = 0; c < C; ++c) d[c] = a.d + (n0 + c) * nb;
  typename Path::Row rows[R];
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    rows[r] = typename Path::Row(a, r0 + r);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) rows[r].begin_block(b);
    for (int c = 0; c < C; ++c) {
      typename Path::Codes q;
      src[c].load(b, q.v);
      src[c].prefetch(b);
      const __m256 db = _mm256_broadcast_ss(d[c] + b);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(db, rows[r].dot(q, b), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.out[(r0 + r) * a.N + n0 + c];
      out = hsum(acc[r][c]) + (add_out ? out : 0.f);
    }
}

// Tile instantiations indexed [rows - 1][cols - 1], so edges use exact shapes.
template <class Src>
using TileFn = void (*)(const LinearArgs&, const Src*, int64_t n0, int64_t r0, bool add_out);

template <class Path, class Src, int R, int... C>
constexpr std::array<TileFn<Src>, sizeof...(C)> tile_row(std::integer_sequence<int, C...>) {
  return {&tile<Path, Src, R, C + 1>...};
}
template <class Path, class Src, int Cols, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  return std::array{tile_row<Path, Src, R + 1>(std::make_integer_sequence<int, Cols>())...};
}

// Few rows of x (M <= kDirectMaxRows): all of them in one tile, kDirectOutputs / M
// weight rows per pass, every block widened in registers from the packed rows.
template <class Path, class Src>
void direct_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  static constexpr auto tiles =
      tile_table<Path, Src, kDirectOutputs>(std::make_integer_sequence<int, int(kDirectMaxRows)>());
  const auto& by_cols = tiles[size_t(a.M - 1)];
  const int64_t per_pass = std::max<int64_t>(1, kDirectOutputs / a.M);
  if (a.m) offset_sums_into_out(a, n0, n1);
  for (int64_t n = n0; n < n1; n += per_pass) {
    const int cols = int(std::min<int64_t>(per_pass, n1 - n));
    Src src[kDirectOutputs];
    for (int c = 0; c < cols; ++c) src[c] = Src{a.qs + (n + c) * a.row_bytes()};
    by_cols[size_t(cols - 1)](a, src, n, 0, a.m != nullptr);
  }
}

// Runs Rows<Src> with the source type of the weight's qtype.
template <template <class> class Rows>
void by_qtype(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  switch (a.qtype) {
    case QType::Q4_0: Rows<Nibbles<true>>::run(a, n0, n1, scratch); break;
    case QType::Q4_1: Rows<Nibbles<false>>::run(a, n0, n1, scratch); break;
    case QType::Q8_0: Rows<Bytes>::run(a, n0, n1, scratch); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
}

}  // namespace tiles
}  // namespace paged::cpu::linear::isa_avx2
PAGED_TARGET_END()
