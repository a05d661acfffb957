// The persistent panels of s16's packed codes in the AVX-512 VNNI build
// (layout: s16_panels_avx512.cpp): where a chunk's columns lie, and their
// codes and scales as the kernels read them, shared by the few-rows kernel
// there and the prompt rows' tiles (kernel_s16_avx512.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "arch/target.h"
#include "arch/x86/linear/int8_avx512.h"
#include "linear/aligned.h"
#include "linear/compact_scales.h"
#include "linear/s16.h"

namespace paged::cpu::linear::isa_avx512 {

constexpr int64_t kHalvesPerSuper = kCompactWeights / kS16Half;

// Halves per byte of compact scales in a panel of this form.
constexpr int64_t halves_per_byte(PanelScales form) { return pairs_form(form) ? 2 : 1; }
// Where compact scales' supers start in a column's d or m: after their bytes.
constexpr int64_t supers_at(PanelScales form, int64_t nh) { return nh / halves_per_byte(form) * kLanes; }

// Where one column's codes and scales lie in a chunk.
struct S16Column {
  const uint8_t* codes;     // [nb][bits][16 rows][4]
  const uint8_t* scales[2]; // d, m (null without offsets), each in `form`
  int64_t nh;
  PanelScales form;
};

struct S16Shape {
  int64_t nb, nh;
  int bits;
  bool offsets;
  PanelScales form;
  explicit S16Shape(const LinearArgs& a, PanelScales f)
      : nb(a.K / kBlock), nh(a.K / kS16Half), bits(a.code_bits), offsets(a.has_offsets()), form(f) {}
  int64_t block_bytes() const { return bits * 64; }
  int64_t scale_bytes() const {  // one of d / m, one column
    switch (form) {
      case PanelScales::F16: return nh * kLanes * 2;
      case PanelScales::Compact:
      case PanelScales::CompactPairs:
      case PanelScales::CompactF16:
      case PanelScales::CompactPairsF16:  // padded to a cache line: each column's codes start on one
        return (supers_at(form, nh) + nh / kHalvesPerSuper * kLanes * super_bytes(form) + 63) / 64 * 64;
      case PanelScales::F32: break;
    }
    return nh * kLanes * 4;
  }
  int64_t column_bytes() const { return nb * block_bytes() + (offsets ? 2 : 1) * scale_bytes(); }
  S16Column column(const uint8_t* chunk, int c) const {
    const uint8_t* base = chunk + c * column_bytes();
    const uint8_t* d = base + nb * block_bytes();
    return {base, {d, offsets ? d + scale_bytes() : nullptr}, nh, form};
  }
};

// GCC 12's AVX-512 intrinsics' undefined pass-through operand (GCC bug
// 105593), as in the kernels' files: column_offsets is not always inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
PAGED_TARGET_BEGIN("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
// Half g's 16 values of a column's scales o, as float32 (scale_at in lanes).
PAGED_ALWAYS_INLINE __m512 lane_scales(const S16Column& col, int o, int64_t g) {
  const uint8_t* s = col.scales[o];
  switch (col.form) {
    case PanelScales::F16:
      return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(s + 2 * g * kLanes)));
    case PanelScales::Compact:
    case PanelScales::CompactPairs:
    case PanelScales::CompactF16:
    case PanelScales::CompactPairsF16: {
      const int pairs = pairs_form(col.form);  // a shift, not a division: per half
      const uint8_t* at = s + supers_at(col.form, col.nh) + (g / kHalvesPerSuper) * kLanes * super_bytes(col.form);
      const __m512 super = super_bytes(col.form) == 2
                               ? _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(at)))
                               : _mm512_load_ps(reinterpret_cast<const float*>(at));
      const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(s + (g >> pairs) * kLanes));
      return _mm512_mul_ps(super, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
    }
    case PanelScales::F32: break;
  }
  return _mm512_load_ps(reinterpret_cast<const float*>(s) + g * kLanes);
}

// hsum8 (quant_linear.h's order) of the offsets' eight chains t, lane by
// lane: 16 outputs at once.
PAGED_ALWAYS_INLINE __m512 chains_hsum8(const __m512 t[8]) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[4]), _mm512_add_ps(t[2], t[6])),
                       _mm512_add_ps(_mm512_add_ps(t[1], t[5]), _mm512_add_ps(t[3], t[7])));
}

// Chains c0 .. c0+J of the offsets (s16.h: half g in chain g % 8, fmas in
// g's order) for x rows xs[i * nh ..], i < R, by a column's m widened into
// lanes (m[g * kLanes ..]); into t[i][c0 + j]. One load of m serves R rows.
template <int R, int J>
PAGED_ALWAYS_INLINE void offset_chains(const float* m, const float* xs, int64_t nh, int c0, __m512 t[][8]) {
  __m512 acc[R][J];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = c0; g < nh; g += 8)
    for (int j = 0; j < J; ++j) {
      const __m512 mv = _mm512_load_ps(m + (g + j) * kLanes);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[i * nh + g + j]), acc[i][j]);
    }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < J; ++j) t[i][c0 + j] = acc[i][j];
}

// Where column_offsets puts row r's 16 sums: out + r * stride, masked;
// added to what is there (the few-rows kernel's outputs) or stored.
struct OffsetsOut {
  float* out;
  int64_t stride;
  __mmask16 mask;
  bool add;
};

// R x rows' offsets by the column (eight chains of J at a time: R * J = 8
// accumulators keep the fmas' latency covered), then hsum8's order.
template <int R, int J>
PAGED_ALWAYS_INLINE void offset_rows(const float* m, const float* xs, int64_t nh, int64_t r, const OffsetsOut& o) {
  __m512 t[R][8];
#pragma GCC unroll 8
  for (int c0 = 0; c0 < 8; c0 += J) offset_chains<R, J>(m, xs + r * nh, nh, c0, t);
  for (int i = 0; i < R; ++i) {
    float* at = o.out + (r + i) * o.stride;
    __m512 v = chains_hsum8(t[i]);
    if (o.add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(o.mask, at), v);
    _mm512_mask_storeu_ps(at, o.mask, v);
  }
}

// The offsets' sums of x rows [0, M) (their xs, [M, nh]) by a column's 16
// weight rows: m widened once per column (not per x row), then the chains
// 8 x rows at a time, the rest 4 / 2 / 1 rows with 2 / 4 / 8 chains at
// once. Chain-major: each chain's fmas are independent of the others', so
// the order is s16.h's (Zen 4, 1B Q5_K_M prompts: rows two at a time with
// all eight chains re-read m for every fma and ran at half the fma rate).
inline void column_offsets(const S16Column& col, const float* xs, int64_t M, const OffsetsOut& o) {
  const int64_t nh = col.nh;
  static thread_local AlignedVector<float> m;
  m.resize(size_t(nh * kLanes));
  const int64_t step = halves_per_byte(col.form);  // compact pairs: one widening for both halves
  for (int64_t g = 0; g < nh; g += step) {
    const __m512 v = lane_scales(col, 1, g);
    for (int64_t i = 0; i < step; ++i) _mm512_store_ps(m.data() + (g + i) * kLanes, v);
  }
  int64_t r = 0;
  for (; r + 8 <= M; r += 8) offset_rows<8, 1>(m.data(), xs, nh, r, o);
  if (r + 4 <= M) offset_rows<4, 2>(m.data(), xs, nh, r, o), r += 4;
  if (r + 2 <= M) offset_rows<2, 4>(m.data(), xs, nh, r, o), r += 2;
  if (r < M) offset_rows<1, 8>(m.data(), xs, nh, r, o);
}

// Step s of half h of a block (f = 4h + s): u of 16 rows' 4 codes a
// lane, from its base dword (f % B, at bit B (f / B)) and its high dword's
// field (H * f / 8, at bit H * f % 8), moved to bit B by an and and an
// immediate shift (no field leaves its byte).
template <int Bits, int h, int s>
PAGED_ALWAYS_INLINE __m512i step_codes(const __m512i* base, const __m512i* high) {
  constexpr int B = s16_base_bits(Bits), H = Bits - B, f = 4 * h + s, low_at = B * (f / B);
  const __m512i low = low_at ? _mm512_srli_epi16(base[f % B], low_at) : base[f % B];
  __m512i u = _mm512_and_si512(low, _mm512_set1_epi8(char((1 << B) - 1)));
  if constexpr (H > 0) {
    constexpr int at = H * f % 8;
    const __m512i field = _mm512_and_si512(high[H * f / 8], _mm512_set1_epi8(char(((1 << H) - 1) << at)));
    if constexpr (at <= B) u = _mm512_or_si512(u, _mm512_slli_epi16(field, B - at));
    else u = _mm512_or_si512(u, _mm512_srli_epi16(field, at - B));
  }
  return u;
}

PAGED_TARGET_END()
#pragma GCC diagnostic pop

// Chunk [n0, ..)'s panel in a call's persistent panels (LinearArgs::panels).
inline const uint8_t* s16_chunk(const LinearArgs& a, int64_t n0) {
  return a.panels + (n0 / kPanel) * s16_panel_chunk_bytes(a, a.panel_scales);
}

}  // namespace paged::cpu::linear::isa_avx512
