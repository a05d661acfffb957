// Persistent int8 weight panels: the header, the checks at the boundary and
// the build over chunks (weight_panels.h). Compiled for every architecture;
// the active linear build says whether it has a layout (kernel_builds.cpp:
// x86-64's avx512 and amx).
#include "linear/weight_panels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention/kernel_common.h"
#include "attention/tensor_args.h"
#include "kernel_builds.h"
#include "linear/compact_scales.h"
#include "linear/int8.h"
#include "runtime/parallel.h"

namespace nb = nanobind;

namespace paged::cpu::linear {
namespace {

using attn::fail;

constexpr char kMagic[8] = {'P', 'G', 'P', 'A', 'N', 'E', 'L', '1'};
constexpr int64_t kHeaderBytes = 64;  // keeps the panels 64-byte aligned

struct Header {
  char magic[8];
  char layout[24];
  int64_t qtype, n, k, scales;  // scales: the PanelScales form
};
static_assert(sizeof(Header) == kHeaderBytes, "the header is one cache line");

// The active build's panel layout, or nullptr for builds without one.
const char* layout_name() { return active_kernels().panel_layout; }

// Bytes per chunk of the active build's layout, 0 when it has none.
int64_t chunk_bytes(const LinearArgs& a, PanelScales form) {
  const Kernels k = active_kernels();
  return k.panel_chunk_bytes ? k.panel_chunk_bytes(a, form) : 0;
}

// v's bits survive a round trip through fp16 (NaNs other than the one fp16 widens to do not)
bool is_fp16_value(float v) {
  const float back = attn::f16_to_float(attn::float_to_f16(v));
  return std::memcmp(&back, &v, sizeof v) == 0;
}

// Whether every half's byte of s16's compact d (and m) equals its pair's:
// one byte per 32 weights then holds them (PanelScales::CompactPairs).
bool compact_pairs(const LinearArgs& a) {
  const int64_t nh = a.scales(), row = compact_row_bytes(nh, a.K);
  for (const uint8_t* c : {a.d8, a.m8})
    for (int64_t n = 0; c && n < a.N; ++n)
      for (int64_t g = 0; g < nh; g += 2)
        if (c[n * row + g] != c[n * row + g + 1]) return false;
  return true;
}

// Whether every super of a's compact scales (d and m) is an fp16 value.
bool compact_supers_fp16(const LinearArgs& a) {
  const int64_t scales = a.scales(), row = compact_row_bytes(scales, a.K), supers = a.K / kCompactWeights;
  for (const uint8_t* c : {a.d8, a.m8})
    for (int64_t n = 0; c && n < a.N; ++n)
      for (int64_t g = 0; g < supers; ++g) {
        float v;
        std::memcpy(&v, c + n * row + scales + 4 * g, sizeof v);
        if (!is_fp16_value(v)) return false;
      }
  return true;
}

// The most compact exact form of a's scales (PanelScales): compact scales
// as they are, their supers as fp16 where each is an fp16 value (GGUF's d
// and -dmin); d (and m) as fp16 when each is an fp16 value (GGUF's, widened
// at load), else float32. One pass over the scales, per build of the panels.
PanelScales scales_form(const LinearArgs& a) {
  if (a.d8) {
    const bool pairs = a.qtype == QType::S16 && compact_pairs(a), f16 = compact_supers_fp16(a);
    return pairs ? (f16 ? PanelScales::CompactPairsF16 : PanelScales::CompactPairs)
                 : (f16 ? PanelScales::CompactF16 : PanelScales::Compact);
  }
  const int64_t count = a.N * a.scales();
  for (const float* s : {a.d, a.m})
    if (s && !std::all_of(s, s + count, is_fp16_value)) return PanelScales::F32;
  return PanelScales::F16;
}

int64_t chunks(const LinearArgs& a) { return (a.N + kI8ChunkRows - 1) / kI8ChunkRows; }

// Panels are q4_0 / q4_1 / q8_0's (bytes or packed) and s16's packed codes'.
void require_panel_qtype(const LinearArgs& a) {
  if (a.qtype == QType::S16 && (a.code_bits == 8 || a.code_blocks || a.d16))
    fail("qtype", "'q4_0', 'q4_1', 'q8_0', 'q8_0.s5', 'q8_0.nl4' or packed s16 codes ('s16.u2' .. 's16.s6'; byte "
         "codes have no panel layout, nor do codes packed per block or half-pair scales)",
         "'s16' codes of that form");
}

int64_t total_bytes(const LinearArgs& a, PanelScales form) {
  require_panel_qtype(a);
  const int64_t per_chunk = chunk_bytes(a, form);
  if (per_chunk == 0)
    fail("linear ISA", "a build with weight panels ('avx512', 'amx')", "'" + std::string(current_isa()) + "'");
  return kHeaderBytes + chunks(a) * per_chunk;
}

Header header_for(const LinearArgs& a, PanelScales form, const std::string& layout = weight_panel_layout()) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  std::memcpy(h.layout, layout.data(), std::min(layout.size(), sizeof h.layout - 1));
  // the type, its code form and whether it has offsets: each changes the panel
  h.qtype = int64_t(a.qtype) | int64_t(a.code_bits) << 8 | int64_t(a.code_bias) << 16 | int64_t(a.has_offsets()) << 24;
  h.n = a.N;
  h.k = a.K;
  h.scales = int64_t(form);
  return h;
}

// `panels` as a uint8 1-D tensor, 64-byte aligned, of `bytes` bytes (or, with
// `header`, at least a header's, which is copied there for the caller to size it).
uint8_t* panel_data(const Array& panels, int64_t bytes, Header* header = nullptr) {
  const attn::TensorArg t = attn::any_tensor("panels", panels);
  if (panels.dtype() != nb::dtype<uint8_t>() || t.shape.size() != 1)
    fail("panels", "a 1-D uint8 tensor", "shape " + t.shape_str());
  if (reinterpret_cast<uintptr_t>(t.data) % 64 != 0) fail("panels", "64-byte aligned data", "an offset view");
  if (header && t.dim(0) >= kHeaderBytes) std::memcpy(header, t.data, sizeof *header);
  if (!header && t.dim(0) != bytes)
    fail("panels", std::to_string(bytes) + " bytes for this weight (weight_panel_bytes)",
         std::to_string(t.dim(0)) + " bytes");
  return static_cast<uint8_t*>(t.data);
}

// The layout a header names.
std::string layout_of(const Header& h) { return std::string(h.layout, strnlen(h.layout, sizeof h.layout)); }

// The scale form of panels with header h for a's scales: the header's where
// it suits them (a compact form for compact scales; else fp16 or float32),
// else one that does. The caller checks the whole header against it.
PanelScales header_form(const LinearArgs& a, const Header& h) {
  const bool known = h.scales >= int64_t(PanelScales::F32) && h.scales <= int64_t(PanelScales::CompactPairsF16);
  const auto form = known ? PanelScales(h.scales) : PanelScales::F32;
  if (a.d8) return compact_form(form) ? form : PanelScales::Compact;
  return form == PanelScales::F16 ? PanelScales::F16 : PanelScales::F32;
}

// A build's layout name as headers carry it: the version counts layout changes.
std::string versioned(const char* layout) { return layout + std::string("/5"); }

}  // namespace

std::string weight_panel_layout() {
  LinearArgs probe;
  probe.qtype = QType::Q4_0;
  probe.K = kBlock;
  return chunk_bytes(probe, PanelScales::F32) ? versioned(layout_name()) : "";
}

namespace {

// The kernels of a build this CPU runs whose layout a header names (active or
// not: panels outlive a switch of builds), or null.
const Kernels* layout_kernels(const Header& h) {
  static const std::vector<LinearBuild> builds = linear_builds();
  for (const LinearBuild& b : builds)
    if (b.kernel.panel_layout && b.kernel.unpack_panel_chunk && b.supported() &&
        versioned(b.kernel.panel_layout) == layout_of(h))
      return &b.kernel;
  return nullptr;
}

}  // namespace

int64_t weight_panel_bytes(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  return total_bytes(a, scales_form(a));
}

void build_weight_panels(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m,
                         const Array& out) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  a.panel_scales = scales_form(a);
  uint8_t* dst = panel_data(out, total_bytes(a, a.panel_scales));
  const Header h = header_for(a, a.panel_scales);
  const int64_t per_chunk = chunk_bytes(a, a.panel_scales);
  const auto build_chunk = active_kernels().build_panel_chunk;  // total_bytes checked that there is one
  nb::gil_scoped_release no_gil;
  std::memcpy(dst, &h, sizeof h);
  parallel_for(chunks(a), true, Schedule::Static, 1, [&](int64_t c) {
    const int64_t n0 = c * kI8ChunkRows;
    build_chunk(a, n0, std::min(a.N, n0 + kI8ChunkRows), dst + kHeaderBytes + c * per_chunk);
  });
}

bool weight_panels_match_build(const Array& panels) {
  if (panels.ndim() != 1 || panels.dtype() != nb::dtype<uint8_t>() || int64_t(panels.size()) < kHeaderBytes)
    return false;
  Header h;
  std::memcpy(&h, panels.data(), sizeof h);
  return std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 && weight_panel_layout() == layout_of(h);
}

const uint8_t* check_panels(LinearArgs& a, const Array& panels) {
  Header h{};  // the whole header, then the size are checked against a and its form
  panel_data(panels, 0, &h);
  a.panel_scales = header_form(a, h);
  const int64_t bytes = total_bytes(a, a.panel_scales);  // fails under a build without panels
  const Header want = header_for(a, a.panel_scales);
  if (std::memcmp(&h, &want, sizeof h) != 0)
    fail("panels", "panels built for this weight under linear ISA '" + std::string(current_isa()) + "'",
         "panels of another weight or build ('" + layout_of(h) + "')");
  return panel_data(panels, bytes) + kHeaderBytes;
}

void unpack_weight_panels(const std::string& qtype, const Array& panels, const Array& qs, const Array& d,
                          const std::optional<Array>& m, int64_t first_row) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);  // the rows to fill: their shapes and scale form
  require_panel_qtype(a);
  Header h{};
  panel_data(panels, 0, &h);
  const Kernels* k = layout_kernels(h);
  const std::string layout = layout_of(h);
  if (!k || std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    fail("panels", "build_weight_panels' tensor of a layout this CPU runs", "'" + layout + "'");
  if (first_row < 0 || first_row % kI8ChunkRows != 0 || first_row + a.N > h.n)
    fail("first_row", "a multiple of " + std::to_string(kI8ChunkRows) + " with the rows to fill inside the weight's " +
                          std::to_string(h.n), std::to_string(first_row) + " for " + std::to_string(a.N) + " rows");
  a.panel_scales = header_form(a, h);
  LinearArgs whole = a;  // the weight the panels were built for: rows [first_row, first_row + N) of it
  whole.N = h.n;
  const Header want = header_for(whole, a.panel_scales, layout);
  if (std::memcmp(&h, &want, sizeof h) != 0)
    fail("panels", "panels built for this weight", "panels of another weight (or of the other scale form)");
  const int64_t per_chunk = k->panel_chunk_bytes(a, a.panel_scales);
  const uint8_t* src = panel_data(panels, kHeaderBytes + chunks(whole) * per_chunk) + kHeaderBytes +
                       first_row / kI8ChunkRows * per_chunk;
  nb::gil_scoped_release no_gil;
  parallel_for(chunks(a), chunks(a) > 1, Schedule::Static, 1, [&](int64_t c) {
    const int64_t n0 = c * kI8ChunkRows;  // rows of the arrays filled, from the chunk at first_row + n0
    k->unpack_panel_chunk(a, n0, std::min(a.N, n0 + kI8ChunkRows), src + c * per_chunk);
  });
}

}  // namespace paged::cpu::linear
