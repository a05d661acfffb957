// AMX-BF16 kernel of the bfloat16 prompt rows (bf16_prompt.h): per group
// of 32 rows of x and chunk of 32 outputs, over the whole K, four 16 x 16
// float32 accumulator tiles (2 x 2: each A tile of x serves two B tiles of
// the weight and each B tile two A tiles), 4 tdpbf16ps per step of 32. The
// B tiles are a bfloat16 copy's (bf16_linear) or, for quant_linear's prompt
// rows, made per chunk from the int8 kernels' panel (panel_tiles): the same
// values either way.
//
// The tile loads from L2 are the bound, not the unit: x is packed per step
// (both A tiles in one 2 KB run) and the next step's x prefetched into L1.
#include "linear/bf16_prompt.h"

#include <algorithm>
#include <cstring>

#include "arch/x86/amx/amx_tiles.h"
#include "arch/x86/linear/int8_avx512.h"
#include "linear/aligned.h"

PAGED_TARGET_BEGIN(PAGED_AMX_ISA)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC bug 105593, as in the AVX-512 build
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace paged::cpu::linear::isa_amx_bf16 {
namespace {

constexpr int kTile = 16;                          // rows (and bf16 pairs) of a tile
constexpr int64_t kTileElems = kTile * 2 * kTile;  // bf16 elements of one 1 KB tile
constexpr int64_t kStepElems = kBf16Rows * kBf16Step;  // a group's x per step (2 tiles)

constexpr amx::TileConfig kConfig = amx::full_tiles_config();  // 16 x 32 bf16 or 16 x 16 fp32

// Tiles: x A0 (rows 0-15), A1 (rows 16-31); weight B0 (columns 0-15), B1
// (16-31); sums C[row tile][column tile] = 4 + 2 * row tile + column tile.
template <bool TwoRowTiles>
PAGED_ALWAYS_INLINE void sweep(const uint16_t* x, const uint16_t* w0, const uint16_t* w1, int64_t steps) {
  using namespace amx;
  tile_zero<4>();
  tile_zero<5>();
  if constexpr (TwoRowTiles) {
    tile_zero<6>();
    tile_zero<7>();
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* xs = x + s * kStepElems;
    // the next step's x into L1 (the weight tiles are reused by every group
    // of the chunk and stay near)
    const char* next = reinterpret_cast<const char*>(xs + kStepElems);
    for (int l = 0; l < (TwoRowTiles ? 32 : 16); ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    tile_load<0>(xs, 64);
    if constexpr (TwoRowTiles) tile_load<1>(xs + kTileElems, 64);
    tile_load<2>(w0 + s * kTileElems, 64);
    tile_load<3>(w1 + s * kTileElems, 64);
    tile_dot_bf16<4, 0, 2>();
    tile_dot_bf16<5, 0, 3>();
    if constexpr (TwoRowTiles) {
      tile_dot_bf16<6, 1, 2>();
      tile_dot_bf16<7, 1, 3>();
    }
  }
}

// RNE to bfloat16 (torch's c10::round_to_nearest_even), NaN -> 0x7FC0: the
// 16 results in the low halves of 32-bit lanes.
PAGED_ALWAYS_INLINE __m512i bf16_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

PAGED_ALWAYS_INLINE __m256i to_bf16(__m512 v) { return _mm512_cvtepi32_epi16(bf16_lanes(v)); }

// One group of x rows (<= 32) times one chunk's two B tile columns over all
// K, into out[rows, cols] (row stride a.N).
PAGED_ALWAYS_INLINE void group(const Bf16Args& a, const uint16_t* x, const uint16_t* w0, const uint16_t* w1,
                               int64_t rows, int64_t cols, float* out) {
  const int64_t steps = a.K / kBf16Step;
  amx::ensure_config(kConfig);
  const bool two = rows > kTile;
  if (two)
    sweep<true>(x, w0, w1, steps);
  else
    sweep<false>(x, w0, w1, steps);
  if (rows == (two ? kBf16Rows : kTile) && cols == kBf16Cols) {  // whole tiles straight into out
    const int64_t stride = a.N * int64_t(sizeof(float));
    amx::tile_store<4>(out, stride);
    amx::tile_store<5>(out + kTile, stride);
    if (two) {
      amx::tile_store<6>(out + kTile * a.N, stride);
      amx::tile_store<7>(out + kTile * a.N + kTile, stride);
    }
    return;
  }
  alignas(64) float stage[kBf16Rows][kBf16Cols];  // an edge item: through the stage, valid part copied
  const int64_t stride = kBf16Cols * int64_t(sizeof(float));
  amx::tile_store<4>(&stage[0][0], stride);
  amx::tile_store<5>(&stage[0][kTile], stride);
  if (two) {
    amx::tile_store<6>(&stage[kTile][0], stride);
    amx::tile_store<7>(&stage[kTile][kTile], stride);
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * a.N, stage[r], size_t(cols) * sizeof(float));
}

// The chunk's B tiles from its int8 panel (int8_avx512.h): per column c and
// block b, tiles[c][b][kk][n][j] = bf16(W[n0 + 16 c + n][32 b + 2 kk + j]),
// W dequantized as quant_dequantize does (d * q, then + m for q4_1, each
// rounded on its own). d * q is exact in float32 (d has an fp16's 11
// significant bits, q at most 8), so q4_1's d * q + m is one fma with the
// same bits, and a 4-bit code becomes its float by a vpermps from a 16-entry
// table (which reads only the index's low 4 bits, so no mask): per 64
// weights 18 vector ops instead of 27 (the tile source is the fixed cost of
// every call with prompt rows, docs/kernels.md).
template <QType T>
void panel_tiles(const isa_avx512::PanelView& p, int64_t nb, uint16_t* tiles) {
  using isa_avx512::kCols;
  using isa_avx512::kLanes;
  using isa_avx512::kPanel;
  using isa_avx512::kSteps;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  // panel codes are unsigned: the nibble (its value, minus 8 for q4_0, from
  // this table), or the q8 code + 128
  const __m512 values = T == QType::Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                         : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i offset = _mm512_set1_epi32(128);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int c = 0; c < kCols; ++c)
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 d = isa_avx512::panel_scale(p, false, b, c);
      const __m512 m = T == QType::Q4_1 ? isa_avx512::panel_scale(p, true, b, c) : _mm512_setzero_ps();
      uint16_t* dst = tiles + (c * nb + b) * kTileElems;
      for (int s = 0; s < kSteps; ++s) {  // codes 4s .. 4s+3 of 16 rows: tile rows 2s and 2s + 1
        const __m512i v = _mm512_load_si512(p.codes + ((b * kSteps + s) * kCols + c) * 64);
        __m512 w[4];
        for (int j = 0; j < 4; ++j) {
          const __m512i lanes = j ? _mm512_srli_epi32(v, 8 * j) : v;
          if constexpr (T == QType::Q8_0) {
            const __m512i q = _mm512_sub_epi32(_mm512_and_si512(lanes, byte), offset);
            w[j] = _mm512_mul_round_ps(_mm512_cvtepi32_ps(q), d, kRound);
          } else {
            const __m512 q = _mm512_permutexvar_ps(lanes, values);
            w[j] = T == QType::Q4_1 ? _mm512_fmadd_round_ps(q, d, m, kRound) : _mm512_mul_round_ps(q, d, kRound);
          }
        }
        // (even k, odd k) pairs per output; vcvtne2ps2bf16 rounds as torch
        // does for every finite value here (gguf weights are multiples of
        // 2^-24: never subnormal, which it would flush)
        _mm512_store_si512(dst + 2 * s * 32, amx::bf16_pairs(w[0], w[1]));
        _mm512_store_si512(dst + (2 * s + 1) * 32, amx::bf16_pairs(w[2], w[3]));
      }
    }
}

}  // namespace

void pack_group(const float* x, int64_t M, int64_t K, int64_t g, uint16_t* packed) {
  const int64_t steps = K / kBf16Step;
  uint16_t* dst = packed + g * steps * kStepElems;
  for (int64_t i = 0; i < kBf16Rows; ++i) {
    const int64_t r = g * kBf16Rows + i;
    for (int64_t s = 0; s < steps; ++s) {
      auto* d = reinterpret_cast<__m256i*>(dst + s * kStepElems + i * kBf16Step);
      if (r < M) {
        const float* src = x + r * K + s * kBf16Step;
        _mm256_storeu_si256(d, to_bf16(_mm512_loadu_ps(src)));
        _mm256_storeu_si256(d + 1, to_bf16(_mm512_loadu_ps(src + 16)));
      } else {
        _mm256_storeu_si256(d, _mm256_setzero_si256());
        _mm256_storeu_si256(d + 1, _mm256_setzero_si256());
      }
    }
  }
}

void item(const Bf16Args& a, int64_t i) {
  const int64_t groups = a.groups(), steps = a.K / kBf16Step;
  const int64_t g = i % groups, c = i / groups;
  const uint16_t* w0 = a.w + 2 * c * steps * kTileElems;
  group(a, a.x + g * steps * kStepElems, w0, w0 + steps * kTileElems, std::min(kBf16Rows, a.M - g * kBf16Rows),
        std::min(kBf16Cols, a.N - c * kBf16Cols), a.out + g * kBf16Rows * a.N + c * kBf16Cols);
}

void panel_rows(const Bf16Args& a, const isa_avx512::PanelView& p, QType t, int64_t n0, int64_t n1) {
  const int64_t steps = a.K / kBf16Step;
  static thread_local AlignedVector<uint16_t> tiles;  // the chunk's B tiles, reused by every group
  if (tiles.size() < size_t(2 * steps * kTileElems)) tiles.resize(size_t(2 * steps * kTileElems));
  switch (t) {
    case QType::Q4_0: panel_tiles<QType::Q4_0>(p, steps, tiles.data()); break;
    case QType::Q4_1: panel_tiles<QType::Q4_1>(p, steps, tiles.data()); break;
    case QType::Q8_0: panel_tiles<QType::Q8_0>(p, steps, tiles.data()); break;
    case QType::S16: break;  // s16 weights take Kernels::s16_rows, never this kernel
  }
  const uint16_t* w0 = tiles.data();
  for (int64_t g = 0; g < a.groups(); ++g)
    group(a, a.x + g * steps * kStepElems, w0, w0 + steps * kTileElems, std::min(kBf16Rows, a.M - g * kBf16Rows),
          n1 - n0, a.out + g * kBf16Rows * a.N + n0);
}

}  // namespace paged::cpu::linear::isa_amx_bf16

#pragma GCC diagnostic pop
PAGED_TARGET_END()
