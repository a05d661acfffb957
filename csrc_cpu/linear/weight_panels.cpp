// Persistent int8 weight panels: the header, the checks at the boundary and
// the build over chunks (weight_panels.h). Compiled for every architecture;
// the active linear build says whether it has a layout (kernel_builds.cpp:
// x86-64's avx512 and amx).
#include "linear/weight_panels.h"

#include "linear/compact_scales.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention/tensor_args.h"
#include "kernel_builds.h"
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
  int64_t qtype, n, k, reserved;
};
static_assert(sizeof(Header) == kHeaderBytes, "the header is one cache line");

// The active build's panel layout, or nullptr for builds without one.
const char* layout_name() { return active_kernels().panel_layout; }

// Bytes per chunk of the active build's layout, 0 when it has none.
int64_t chunk_bytes(QType t, int64_t K) {
  const Kernels k = active_kernels();
  return k.panel_chunk_bytes ? k.panel_chunk_bytes(t, K) : 0;
}

int64_t chunks(const LinearArgs& a) { return (a.N + kI8ChunkRows - 1) / kI8ChunkRows; }

int64_t total_bytes(const LinearArgs& a) {
  if (a.qtype == QType::S16) fail("qtype", "'q4_0', 'q4_1' or 'q8_0' (s16 has no panel layout)", "'s16'");
  const int64_t per_chunk = chunk_bytes(a.qtype, a.K);
  if (per_chunk == 0)
    fail("linear ISA", "a build with weight panels ('avx512', 'amx')", "'" + std::string(current_isa()) + "'");
  return kHeaderBytes + chunks(a) * per_chunk;
}

Header header_for(const LinearArgs& a) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  const std::string layout = weight_panel_layout();
  std::memcpy(h.layout, layout.data(), std::min(layout.size(), sizeof h.layout - 1));
  h.qtype = int64_t(a.qtype);
  h.n = a.N;
  h.k = a.K;
  return h;
}

// `panels` as a uint8 1-D tensor of `bytes` bytes, 64-byte aligned.
uint8_t* panel_data(const Array& panels, int64_t bytes) {
  const attn::TensorArg t = attn::any_tensor("panels", panels);
  if (panels.dtype() != nb::dtype<uint8_t>() || t.shape.size() != 1)
    fail("panels", "a 1-D uint8 tensor", "shape " + t.shape_str());
  if (t.dim(0) != bytes)
    fail("panels", std::to_string(bytes) + " bytes for this weight (weight_panel_bytes)",
         std::to_string(t.dim(0)) + " bytes");
  if (reinterpret_cast<uintptr_t>(t.data) % 64 != 0) fail("panels", "64-byte aligned data", "an offset view");
  return static_cast<uint8_t*>(t.data);
}

}  // namespace

std::string weight_panel_layout() { return chunk_bytes(QType::Q4_0, kBlock) ? layout_name() + std::string("/2") : ""; }

int64_t weight_panel_bytes(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  return total_bytes(a);
}

void build_weight_panels(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m,
                         const Array& out) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  uint8_t* dst = panel_data(out, total_bytes(a));
  const Header h = header_for(a);
  const int64_t per_chunk = chunk_bytes(a.qtype, a.K);
  const auto build_chunk = active_kernels().build_panel_chunk;  // total_bytes checked that there is one
  nb::gil_scoped_release no_gil;
  // compact scales (compact_scales.h): the panels hold them widened and transposed, by the
  // build as it transposes them (int8_reads_compact_scales) or from all rows widened here
  if (!active_kernels().int8_reads_compact_scales) widen_all_rows(a, active_kernels().widen_compact);
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
  return std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 && weight_panel_layout() == std::string(h.layout);
}

const uint8_t* check_panels(const LinearArgs& a, const Array& panels) {
  const uint8_t* data = panel_data(panels, total_bytes(a));
  Header h;
  std::memcpy(&h, data, sizeof h);
  const Header want = header_for(a);
  if (std::memcmp(&h, &want, sizeof h) != 0)
    fail("panels", "panels built for this weight under linear ISA '" + std::string(current_isa()) + "'",
         "panels of another weight or build ('" + std::string(h.layout, strnlen(h.layout, sizeof h.layout)) + "')");
  return data + kHeaderBytes;
}

}  // namespace paged::cpu::linear
