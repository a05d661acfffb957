// What the AMX kernels share (kernel_i8_amx.cpp: int8 block sums,
// kernel_bf16_amx.cpp: bfloat16 prompt rows, prompt_bf16_amx.cpp: their
// attention): the one target of every AMX function, the tile configuration
// check and the tile instructions with the tile number a template argument.
// Compiled where CMake finds a compiler that knows AMX (GCC 11, clang 12);
// the OS's grant of the tile state is part of the builds' predicates
// (kernel_builds.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "arch/target.h"

// One target for every AMX function, so the shared helpers inline into every
// kernel; each kernel is offered only where the CPU has its own unit.
#define PAGED_AMX_ISA \
  "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16"

PAGED_TARGET_BEGIN(PAGED_AMX_ISA)
namespace paged::cpu::linear::amx {

// A tile configuration (palette 1), as ldtilecfg reads it.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// All eight tiles at their full 16 rows x 64 bytes (16 x 32 bfloat16, 16 x
// 16 float32): what the bfloat16 kernels (prompt rows' linears and
// attention) run under.
constexpr TileConfig full_tiles_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.bytes_per_row[t] = 64;
  return c;
}

// Loads `want` unless this thread's tiles already run it: one sttilecfg and
// a compare per call, much cheaper than an ldtilecfg. Another kernel or
// library on the thread (oneDNN in torch) may have loaded its own since,
// which the compare sees.
PAGED_ALWAYS_INLINE void ensure_config(const TileConfig& want) {
  TileConfig have;
  _tile_storeconfig(&have);
  if (std::memcmp(&have, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

// Two vectors' 16 float lanes as 16 bfloat16 pairs (a B tile row, or an A
// tile row of pairs): word 2n = bf16(a[n]), 2n + 1 = bf16(b[n]), rounded to
// nearest even by vcvtne2ps2bf16 (which treats subnormals as zero).
PAGED_ALWAYS_INLINE __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// As GCC's own intrinsics: a store clobbers memory (results are read back
// right after), a load and a dot product do not (what they read was written
// before the call).
template <int T>
PAGED_ALWAYS_INLINE void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "n"(T));
}
template <int T>
PAGED_ALWAYS_INLINE void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "n"(T) : "memory");
}
template <int T>
PAGED_ALWAYS_INLINE void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"n"(T));
}
template <int S, int X, int W>  // S += X (signed bytes) . W (unsigned bytes), in groups of 4
PAGED_ALWAYS_INLINE void tile_dot_i8() {
  asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(S), "n"(X), "n"(W));
}
template <int S, int X, int W>  // S += X . W on bfloat16 pairs, float32 sums
PAGED_ALWAYS_INLINE void tile_dot_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(S), "n"(X), "n"(W));
}

}  // namespace paged::cpu::linear::amx

PAGED_TARGET_END()
