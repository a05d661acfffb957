// Persistent int8 weight panels (issue #15): the panel the AVX-512 int8
// kernel builds per call and per 32-row chunk (kernel_i8_avx512.cpp: codes
// widened to bytes in its interleaved layout, d and q4_1's m transposed),
// built once for a whole matrix into a caller-owned uint8 tensor and read by
// every later call instead. The arithmetic and the bits are unchanged: the
// kernel reads the same bytes from elsewhere.
//
// The tensor: a 64-byte header (magic, the build's layout name, qtype, N, K,
// the scales' PanelScales form), then one panel per chunk of kI8ChunkRows
// weight rows, panel_chunk_bytes each (the packed size: q8_0's codes as
// bytes, 4-bit codes as nibbles, the scales as fp16, compact or float32:
// the most compact form that holds them exactly). Only builds with a layout have panels (today "avx512", which the
// amx builds read too, a 4-bit chunk's nibbles widened to bytes per item);
// quant_linear refuses a tensor whose header names another layout, qtype or
// shape, so a cache built under one layout is never read by another
// (set_linear_isa switches builds).
#pragma once

#include <optional>
#include <string>

#include "linear/ops.h"

namespace paged::cpu::linear {

// The active build's panel layout ("avx512/2"), or "" when it has none.
std::string weight_panel_layout();
// Bytes of the panels of this weight for the active build (ValueError when it has none).
int64_t weight_panel_bytes(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m);
// Builds them into `out` (uint8, 1-D, weight_panel_bytes long, 64-byte aligned).
void build_weight_panels(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m,
                         const Array& out);
// build_weight_panels' inverse: the weight's arrays (qs, d, m as
// quant_linear takes them, compact d / m where the panels hold compact
// scales) written back from its panels, bit for bit, under any build of this
// CPU (a matrix may keep only its panels: backends/cpu/quant_linear.py);
// the arrays' rows are the weight's from first_row on (a multiple of
// kI8ChunkRows: an embedding lookup unpacks only its rows' chunks).
void unpack_weight_panels(const std::string& qtype, const Array& panels, const Array& qs, const Array& d,
                          const std::optional<Array>& m, int64_t first_row = 0);
// Whether `panels` (a tensor of any content) carries the active build's layout.
bool weight_panels_match_build(const Array& panels);
// The panel bytes past the header for the weight in `a` (qtype, N, K filled),
// a.panel_scales set to the form their header names; ValueError "panels: expected ..., got ..." when they do not fit it or the build.
const uint8_t* check_panels(LinearArgs& a, const Array& panels);

}  // namespace paged::cpu::linear
