// AVX2 unpacking of q8_0's 5-bit packed codes (linear/q8_packed.h): per
// block one 16-byte load split into its two nibble halves, and the fifth
// bits spread to bytes by a shuffle, an and and a compare. The same bytes
// as unpack_q8_rows; ~10 instructions per 32 codes, which the drivers pay
// per work item of every call (decode included).
#include <immintrin.h>

#include <cstring>

#include "arch/target.h"
#include "linear/q8_packed.h"

PAGED_TARGET_BEGIN("avx2")

namespace paged::cpu::linear::isa_avx2 {

void q8_unpack(const uint8_t* packed, int64_t K, int64_t rows, int8_t* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), bias = _mm256_set1_epi8(kQ8PackedBias);
  // byte e takes byte e % 4 of the fifth bits' dword, then its bit e / 4
  const __m256i spread = _mm256_set1_epi32(0x03020100);
  const __m256i bit = _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x10101010, 0x20202020,
                                        0x40404040, int32_t(0x80808080u));
  for (int64_t i = 0; i < rows * (K / kBlock); ++i) {
    const uint8_t* src = packed + i * kQ8PackedBlockBytes;
    const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), low);
    int32_t bits;
    std::memcpy(&bits, src + 16, sizeof bits);
    const __m256i set = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(set, bit), fifth);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * kBlock),
                        _mm256_sub_epi8(_mm256_or_si256(codes, high), bias));
  }
}

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
