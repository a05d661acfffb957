// Compact scales: how weights unpacked from GGUF K-quants keep their block
// scales and offsets (core/models/loaders/quant_layouts.py): per row, one
// signed byte per scale (Q4_K's 6-bit sub-scale or sub-min for a q4_1 block
// of 32; Q6_K's 8-bit scale for an s16 half of 16), then one float32 per
// 256 weights (the super-block's fp16 d, or -dmin, widened): the scale is
// fl(super * float(byte)), exact (an fp16 times 8 bits is at most 19
// significant bits), so the widened floats are the float32 d and m the
// kernels read, bit for bit, in 1.25 instead of 4 bytes per scale. The
// drivers widen a work item's rows into a float32 buffer just before its
// kernel runs (quant_linear.cpp, s16.cpp: ItemWidener), so no kernel knows the form.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "attention/kernel_common.h"
#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int64_t kCompactWeights = 256;  // weights per float32 super value

// A compact panel form's super value at p (PanelScales: float32, or fp16 in
// the *F16 forms) as float32, and v stored there (the caller checked that the
// form holds it exactly).
inline float panel_super(const uint8_t* p, PanelScales form) {
  if (super_bytes(form) == 4) {
    float v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return attn::f16_to_float(h);
}
inline void store_panel_super(uint8_t* p, PanelScales form, float v) {
  if (super_bytes(form) == 4) return void(std::memcpy(p, &v, sizeof v));
  const uint16_t h = attn::float_to_f16(v);
  std::memcpy(p, &h, sizeof h);
}

// Bytes of one row of compact scales: `scales` bytes, then a float32 per 256 weights.
constexpr int64_t compact_row_bytes(int64_t scales, int64_t K) { return scales + 4 * (K / kCompactWeights); }

// Rows [n0, n1) of compact scales c (`scales` per row over K weights) into out [N, scales] float32.
inline void widen_compact_rows(const uint8_t* c, int64_t scales, int64_t K, int64_t n0, int64_t n1, float* out) {
  const int64_t row_bytes = compact_row_bytes(scales, K), per_super = scales / (K / kCompactWeights);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = c + n * row_bytes;
    float* dst = out + n * scales;
    for (int64_t g = 0; g < K / kCompactWeights; ++g) {
      float super;
      std::memcpy(&super, row + scales + 4 * g, sizeof super);
      for (int64_t i = g * per_super; i < (g + 1) * per_super; ++i) dst[i] = super * float(int8_t(row[i]));
    }
  }
}

// A work item's compact scales, widened just before its kernel runs: rows
// [n0, n1) into the calling thread's item buffer (a work item's rows: 16-45
// KiB at 1B shapes, so they stay in L1/L2), as d / m pointers rebased so
// that row n's scales are at d + n * scales, the matrix-wide indexing every
// kernel uses (only rows [n0, n1) are read through them; prefetches past
// them compute their addresses as integers). A [N, scales] scratch per call
// instead wrote and re-read 0.25 bytes a weight through the caches at decode,
// slower than float32 scales read from DRAM (docs/cpu-linear.md).
struct ItemScales {
  const float* d;
  const float* m;
};
// Rows [n0, n1) of fp16 half-pair scales (s16.h) widened, each value for
// both halves of its block (the plain loop; Kernels::widen_half_pairs gives
// the same floats: a widening is exact).
inline void widen_half_pair_rows(const uint16_t* h, int64_t nb, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) out[n * 2 * nb + 2 * b] = out[n * 2 * nb + 2 * b + 1] = attn::f16_to_float(h[n * nb + b]);
}

struct ItemWidener {
  WidenCompact fn = widen_compact_rows;  // the build's (Kernels::widen_compact), same values
  WidenHalfPairs pairs = widen_half_pair_rows;  // the build's (Kernels::widen_half_pairs)
  ItemScales rows(const LinearArgs& a, int64_t n0, int64_t n1) const {
    if (a.d16) return half_pair_rows(a, n0, n1);
    if (!a.d8) return {a.d, a.m};
    static thread_local std::vector<float> buf;
    const int64_t per_row = a.scales(), count = (n1 - n0) * per_row;
    if (buf.size() < size_t(2 * count)) buf.resize(size_t(2 * count));
    float* const d = rebased(buf.data(), n0 * per_row);
    fn(a.d8, per_row, a.K, n0, n1, d);
    float* m = nullptr;
    if (a.m8) {
      m = rebased(buf.data() + count, n0 * per_row);
      fn(a.m8, per_row, a.K, n0, n1, m);
    }
    return {d, m};
  }
  // s16's fp16 half-pair scales (LinearArgs::d16 / m16): each block's value
  // for both of its halves, as float32 (exact: a widening).
  ItemScales half_pair_rows(const LinearArgs& a, int64_t n0, int64_t n1) const {
    static thread_local std::vector<float> buf;
    const int64_t nb = a.K / kBlock, count = (n1 - n0) * 2 * nb;
    if (buf.size() < size_t(2 * count)) buf.resize(size_t(2 * count));
    const auto widen = [&](const uint16_t* src, float* dst) {
      float* const rows = rebased(dst, n0 * 2 * nb);
      pairs(src, nb, n0, n1, rows);
      return rows;
    };
    return {widen(a.d16, buf.data()), a.m16 ? widen(a.m16, buf.data() + count) : nullptr};
  }
  // a with rows [n0, n1)'s scales widened (a itself without compact scales).
  LinearArgs item(LinearArgs a, int64_t n0, int64_t n1) const {
    const ItemScales s = rows(a, n0, n1);
    a.d = s.d;
    a.m = s.m;
    return a;
  }

 private:
  // p - elements, as an integer: the pointer lies before the buffer and is
  // only dereferenced at p + [elements, elements + count).
  static float* rebased(float* p, int64_t elements) {
    return reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(p) - uintptr_t(elements) * sizeof(float));
  }
};
inline ItemWidener item_widener(const Kernels& k) {
  return {k.widen_compact ? k.widen_compact : widen_compact_rows,
          k.widen_half_pairs ? k.widen_half_pairs : widen_half_pair_rows};
}

// All rows of a's compact scales into the calling thread's [N, scales]
// scratch, a.d / a.m pointed at it (the whole-matrix user: dequantization).
// No-op without compact scales.
inline void widen_all_rows(LinearArgs& a, const Kernels& k) {
  const WidenCompact fn = k.widen_compact;
  if (a.d16) {
    const ItemScales s = item_widener(k).half_pair_rows(a, 0, a.N);
    a.d = s.d;
    a.m = s.m;
    return;
  }
  if (!a.d8) return;
  static thread_local std::vector<float> d, m;
  const auto size = size_t(a.N * a.scales());
  if (d.size() < size) d.resize(size);
  (fn ? fn : widen_compact_rows)(a.d8, a.scales(), a.K, 0, a.N, d.data());
  a.d = d.data();
  if (a.m8) {
    if (m.size() < size) m.resize(size);
    (fn ? fn : widen_compact_rows)(a.m8, a.scales(), a.K, 0, a.N, m.data());
    a.m = m.data();
  }
}

}  // namespace paged::cpu::linear
