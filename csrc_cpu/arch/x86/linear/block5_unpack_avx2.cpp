// AVX2 unpacking of 5-bit codes packed per 32-block (linear/q8_packed.h;
// block5_ymm.inc): the same bytes as unpack_block5_rows, ~10 instructions
// per 32 codes, which the drivers pay per work item where no kernel reads
// the packed codes in place.
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

}  // namespace paged::cpu::linear::isa_avx2

PAGED_TARGET_END()
