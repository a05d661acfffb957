// The one way ISA code is annotated (csrc_cpu/CMakeLists.txt says why not
// per-file flags): each ISA file (arch/x86/..., arch/arm/...) includes its
// headers first, then compiles its own code for its ISA in a region
//
//   PAGED_TARGET_BEGIN("avx2,fma,f16c")
//   namespace paged::cpu::... { ... }
//   PAGED_TARGET_END()
//
// Every function defined in the region (lambdas and templates included) gets
// the target; what the headers above it define keeps the baseline, so no
// inline function another file also uses is ever compiled for a newer ISA.
// Regions nest (a header of ISA helpers opens its own inside a kernel's).
#pragma once

#define PAGED_PRAGMA(x) _Pragma(#x)

#if defined(__clang__)
// clang has no #pragma GCC target: the same region as a target attribute on
// every function declared in it.
#define PAGED_TARGET_BEGIN(isa) PAGED_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define PAGED_TARGET_END() PAGED_PRAGMA(clang attribute pop)
#else
#define PAGED_TARGET_BEGIN(isa) PAGED_PRAGMA(GCC push_options) PAGED_PRAGMA(GCC target(isa))
#define PAGED_TARGET_END() PAGED_PRAGMA(GCC pop_options)
#endif

// aarch64 extensions past the baseline's Advanced SIMD: GCC enables them as
// the architecture level its arm_neon.h declares their intrinsics under,
// clang by feature name.
#if defined(__clang__)
#define PAGED_TARGET_ARM_DOTPROD "dotprod"
#define PAGED_TARGET_ARM_I8MM "i8mm"
#else
#define PAGED_TARGET_ARM_DOTPROD "arch=armv8.2-a+dotprod"
#define PAGED_TARGET_ARM_I8MM "arch=armv8.6-a+i8mm"
#endif

// ISA helpers that take or fill arrays of vectors: always inlined, so the
// arrays stay in registers (a lambda takes PAGED_ALWAYS_INLINE_LAMBDA after
// its parameter list).
#define PAGED_ALWAYS_INLINE inline __attribute__((always_inline))
#define PAGED_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
