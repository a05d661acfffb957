// AVX2 unpacking of q8_0's packed codes (linear/q8_packed.h), which the
// drivers pay per work item where no kernel reads them in place: 5-bit codes
// per 32-block (block5_ymm.inc; the same bytes as unpack_block5_rows, ~10
// instructions per 32 codes), and IQ4_NL table indices (one vpshufb per 16
// codes: the same bytes as unpack_table4_rows).
#include <immintrin.h>

#include <cstring>

#include "arch/target.h"
#include "linear/q8_packed.h"

PAGED_TARGET_BEGIN("avx2")

namespace paged::cpu::linear::isa_avx2 {

#include "arch/x86/linear/block5_ymm.inc"

void block5_unpack(const uint8_t* packed, int64_t K, int code_bias, int64_t rows, int8_t* out) {
  const __m256i bias = _mm256_set1_epi8(char(code_bias));
  for (int64_t i = 0; i < rows * (K / kBlock); ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kBlock),
                        _mm256_sub_epi8(block5_codes(packed + i * kQ8PackedBlockBytes), bias));
}

void table4_unpack(const uint8_t* packed, int64_t K, int64_t rows, int8_t* out) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
  const __m256i lut = _mm256_broadcastsi128_si256(table), low = _mm256_set1_epi8(0x0F);
  const int64_t blocks = rows * (K / kBlock);
  int64_t i = 0;
  for (; i + 2 <= blocks; i += 2) {  // two blocks a vector: bytes l of block i, then of block i + 1
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + i * (kBlock / 2)));
    const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low));  // elements l
    const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));  // 16 + l
    // block i: lo's low lane then hi's low lane; block i + 1: the high lanes
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kBlock), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i + 1) * kBlock), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  if (i < blocks) unpack_table4_rows(packed + i * (kBlock / 2), kBlock, 1, out + i * kBlock);
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
