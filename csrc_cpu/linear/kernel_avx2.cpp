// AVX2 + FMA build of the quantized linear. Each 32-weight block is widened
// from its packed bytes to 4 vectors of fp32 codes once and used for a tile of
// up to kTile activation rows; for many rows a weight row's codes are
// converted once into the thread's scratch and re-read from L1.
#include <immintrin.h>

#include "linear/quant_linear.h"

#define PAGED_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace paged::cpu::linear::isa_avx2 {
namespace {

constexpr int kTile = 4;  // activation rows sharing one widened block

// Sources of a block's codes: 4 vectors holding elements 0-7, 8-15, 16-23, 24-31.
template <bool kMinus8>
struct Nibbles {  // Q4_0 (codes q - 8) / Q4_1 (codes q)
  const uint8_t* row;
  // Bytes 0-7 / 8-15 zero-extended to 32-bit lanes: their low nibbles are
  // elements 0-7 / 8-15, their high nibbles (a plain shift) 16-23 / 24-31.
  PAGED_AVX2 void load(int64_t b, __m256 q[4]) const {
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
  PAGED_AVX2 void load(int64_t b, __m256 q[4]) const {
    const uint8_t* p = row + b * kBlock;
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
};

struct Converted {  // codes already widened into scratch
  const float* codes;
  PAGED_AVX2 void load(int64_t b, __m256 q[4]) const {
    for (int i = 0; i < 4; ++i) q[i] = _mm256_loadu_ps(codes + b * kBlock + 8 * i);
  }
};

PAGED_AVX2 inline float hsum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l_i + l_{i+4}
  const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// out[r0 .. r0+R, n] for weight row n whose codes come from `src`.
template <int R, class Src>
PAGED_AVX2 void tile(const LinearArgs& a, const Src& src, int64_t n, int64_t r0) {
  // Locals, so the loop does not re-read a's fields after every store-free step.
  const int64_t nb = a.blocks();
  const float* __restrict d = a.d + n * nb;
  const float* __restrict m = a.m ? a.m + n * nb : nullptr;
  const float* x[R];
  const float* xs[R];
  __m256 acc[R];
  float sm[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.x + (r0 + r) * a.K;
    xs[r] = a.xs + (r0 + r) * nb;
    acc[r] = _mm256_setzero_ps();
    sm[r] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256 q[4];
    src.load(b, q);
    const __m256 db = _mm256_broadcast_ss(d + b);
    for (int r = 0; r < R; ++r) {
      const float* xb = x[r] + b * kBlock;
      __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
      t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
      t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
      acc[r] = _mm256_fmadd_ps(db, t, acc[r]);
    }
  }
  if (m)  // Q4_1's offsets: sum_b m_b * xs_b, same order as in the block loop of the scalar build
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < R; ++r) sm[r] = __builtin_fmaf(m[b], xs[r][b], sm[r]);
  for (int r = 0; r < R; ++r) a.out[(r0 + r) * a.N + n] = hsum(acc[r]) + sm[r];
}

template <class Src>
PAGED_AVX2 void all_rows(const LinearArgs& a, const Src& src, int64_t n) {
  int64_t r = 0;
  for (; r + kTile <= a.M; r += kTile) tile<kTile>(a, src, n, r);
  for (; r < a.M; ++r) tile<1>(a, src, n, r);
}

template <class Src>
PAGED_AVX2 void weight_row(const LinearArgs& a, const Src& src, int64_t n, std::vector<float>& scratch) {
  if (a.M <= kDirectMaxRows) return all_rows(a, src, n);
  scratch.resize(size_t(a.K));
  float* codes = scratch.data();
  const int64_t nb = a.blocks();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 q[4];
    src.load(b, q);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(codes + b * kBlock + 8 * i, q[i]);
  }
  all_rows(a, Converted{codes}, n);
}

}  // namespace

PAGED_AVX2 void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
    switch (a.qtype) {
      case QType::Q4_0: weight_row(a, Nibbles<true>{row}, n, scratch); break;
      case QType::Q4_1: weight_row(a, Nibbles<false>{row}, n, scratch); break;
      case QType::Q8_0: weight_row(a, Bytes{row}, n, scratch); break;
    }
  }
}

}  // namespace paged::cpu::linear::isa_avx2
