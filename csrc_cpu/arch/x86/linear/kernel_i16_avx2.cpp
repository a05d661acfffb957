// AVX2 + FMA build of the int16 path (M <= kInt16MaxRows, quant_linear.h): a
// block's 32 codes become two int16 vectors (elements 0-15, 16-31), shared by
// both activation terms; per term two vpmaddwd and one add give the 8 exact
// int32 lane sums, then per block two converts, a multiply by s, an fma with
// s_lo and an fma with the weight's scale d. Direct tiles only: the codes are
// widened in registers from the packed bytes.
#include "arch/x86/linear/avx2_tiles.h"

PAGED_TARGET_BEGIN("avx2,fma,f16c")
namespace paged::cpu::linear::isa_avx2 {
namespace {

// Exact int32 lane sums of a block's codes times 16 + 16 int16 activations.
inline __m256i lane_dots(const __m256i q[2], const int16_t* x) {
  const __m256i lo = _mm256_madd_epi16(q[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  const __m256i hi = _mm256_madd_epi16(q[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
  return _mm256_add_epi32(lo, hi);
}

struct Int16Path {
  struct Codes {
    __m256i v[2];
  };
  struct Row {
    const int16_t* x = nullptr;  // the row's hi codes of block 0; lo codes follow each block's hi codes
    const float* scales = nullptr;
    __m256 s, s_lo;
    Row() = default;
    Row(const LinearArgs& a, int64_t r) : x(a.xq + r * a.blocks() * kXBlock), scales(a.xscale + r * a.blocks() * 2) {}
    void begin_block(int64_t b) {
      s = _mm256_broadcast_ss(scales + 2 * b);
      s_lo = _mm256_broadcast_ss(scales + 2 * b + 1);
    }
    // t = fma(float(L), s_lo, s * float(I)) over block b.
    __m256 dot(const Codes& q, int64_t b) const {
      const int16_t* xb = x + b * kXBlock;
      const __m256 hi = _mm256_mul_ps(s, _mm256_cvtepi32_ps(lane_dots(q.v, xb)));
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_dots(q.v, xb + kBlock)), s_lo, hi);
    }
  };
};

template <class Src>
struct Int16Rows {
  static void run(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>&) {
    tiles::direct_rows<Int16Path, Src>(a, n0, n1);
  }
};

}  // namespace

void int16_rows(const LinearArgs& a, int64_t n0, int64_t n1, std::vector<float>& scratch) {
  tiles::by_qtype<Int16Rows>(a, n0, n1, scratch);
}

}  // namespace paged::cpu::linear::isa_avx2
PAGED_TARGET_END()
