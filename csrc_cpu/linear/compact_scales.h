// Compact scales: how weights unpacked from GGUF K-quants keep their block
// scales and offsets (core/models/loaders/quant_layouts.py): per row, one
// signed byte per scale (Q4_K's 6-bit sub-scale or sub-min for a q4_1 block
// of 32; Q6_K's 8-bit scale for an s16 half of 16), then one float32 per
// 256 weights (the super-block's fp16 d, or -dmin, widened): the scale is
// fl(super * float(byte)), exact (an fp16 times 8 bits is at most 19
// significant bits), so the widened floats are the float32 d and m the
// kernels read, bit for bit, in 1.25 instead of 4 bytes per scale. The
// drivers widen a work item's rows into a float32 scratch just before its
// kernel runs (quant_linear.cpp, s16.cpp), so no kernel knows the form.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "linear/quant_linear.h"

namespace paged::cpu::linear {

constexpr int64_t kCompactWeights = 256;  // weights per float32 super value

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

// Where a call's compact scales are widened: the calling thread's scratch
// (thread_widened_scales below), shared by its OpenMP team for the call
// through this plain view (a worker naming the thread_local would get its
// own). attach() points a.d / a.m at the scratch when the weight has compact
// scales; widen(a, n0, n1) then fills rows [n0, n1) (each work item its own).
struct WidenedView {
  float* d = nullptr;
  float* m = nullptr;
  WidenCompact fn = widen_compact_rows;  // the build's (Kernels::widen_compact), same values
  void widen(const LinearArgs& a, int64_t n0, int64_t n1) const {
    if (!a.d8) return;
    fn(a.d8, a.scales(), a.K, n0, n1, d);
    if (m) fn(a.m8, a.scales(), a.K, n0, n1, m);
  }
};

struct WidenedScales {
  std::vector<float> d, m;

  WidenedView attach(LinearArgs& a, WidenCompact fn) {
    if (!a.d8) return {};
    const auto size = size_t(a.N * a.scales());
    if (d.size() < size) d.resize(size);
    a.d = d.data();
    if (a.m8) {
      if (m.size() < size) m.resize(size);
      a.m = m.data();
    }
    return {d.data(), a.m8 ? m.data() : nullptr, fn ? fn : widen_compact_rows};
  }
};

// The calling thread's scratch, one for every driver (a call runs through
// one driver, never two nested), so a thread holds one matrix's floats at most.
inline WidenedScales& thread_widened_scales() {
  static thread_local WidenedScales scratch;
  return scratch;
}

}  // namespace paged::cpu::linear
