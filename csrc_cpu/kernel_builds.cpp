// Build tables per architecture (kernel_builds.h). A build listed here is
// compiled for this architecture only (CMakeLists.txt picks the sources by
// name: *avx*/*amx* on x86-64, *neon*/*dotprod* on aarch64).
#include "kernel_builds.h"

#include "linear/int8.h"

namespace paged::cpu {

std::vector<AttentionBuild> attention_builds() {
  return {
#if defined(PAGED_ISA_X86)
      {"avx512", attn::isa_avx512::attention, cpu_has_avx512},
      {"avx2", attn::isa_avx2::attention, cpu_has_avx2},
#elif defined(PAGED_ISA_ARM64)
      {"neon", attn::isa_neon::attention, cpu_has_neon},
#endif
      {"scalar", attn::isa_scalar::attention, cpu_always}};
}

// An ISA name selects all kernels of that build. The VNNI builds differ only
// in the int8 path and reuse the AVX2 float32 kernels (same bits), and amx
// is avx512 with the block sums of calls of >= 8 rows on AMX tiles (same
// bits again); likewise
// dotprod and i8mm reuse NEON's, and every aarch64 build quantizes x with the scalar
// quantizer. int8x2's low term is the scalar definition everywhere but avx512
// and amx (its twin there is bitwise the same).
std::vector<LinearBuild> linear_builds() {
  using namespace linear;
  return {
#if defined(PAGED_ISA_X86)
      {"avx512", {isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avx512::int8_rows, isa_avx512::x8_quantize,
                  isa_avx512::x8_low_term},
       cpu_has_avx512vnni},
      // listed after avx512, so auto never picks it: measured no faster in
      // the engine on the 2-vCPU Xeon here (docs/kernels.md, "AMX"); opt in
      // with PAGED_CPU_ISA=amx or set_linear_isa("amx")
      {"amx", {isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_amx::int8_rows, isa_avx512::x8_quantize,
                  isa_avx512::x8_low_term, true},
       isa_amx::supported},
      {"avxvnni", {isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avxvnni::int8_rows, isa_avx2::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_has_avxvnni},
      {"avx2", {isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avx2::int8_rows, isa_avx2::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_has_avx2},
#elif defined(PAGED_ISA_ARM64)
      {"i8mm", {isa_neon::int16_rows, isa_neon::fp32_rows, isa_i8mm::int8_rows, isa_scalar::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_has_i8mm},
      {"dotprod", {isa_neon::int16_rows, isa_neon::fp32_rows, isa_dotprod::int8_rows, isa_scalar::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_has_dotprod},
      {"neon", {isa_neon::int16_rows, isa_neon::fp32_rows, isa_neon::int8_rows, isa_scalar::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_has_neon},
#endif
      {"scalar", {isa_scalar::int16_rows, isa_scalar::fp32_rows, isa_scalar::int8_rows, isa_scalar::x8_quantize,
                  isa_scalar::x8_low_term},
       cpu_always}};
}

}  // namespace paged::cpu
