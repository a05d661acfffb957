// Boundary checks, the choice of path (activations "int8"/"int8x2", else int16 or fp32
// by M; quant_linear.h, int8.h), the quantization of x, the split over weight
// rows (parallel_for: OpenMP, or the std::thread pool without it) and the ISA
// choice for the quantized linear; the per-ISA kernels do the arithmetic.
#include "linear/ops.h"
#include "kernel_builds.h"

#include "linear/compact_scales.h"
#include "runtime/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#include "attention/tensor_args.h"
#include "linear/bf16_prompt.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"
#include "linear/weight_panels.h"

namespace nb = nanobind;

namespace paged::cpu::linear {
namespace {

using attn::fail;

constexpr int64_t kRowsPerChunk = 24;  // weight rows per OpenMP work item (whole AVX2 register tiles)

// "s16" with packed codes (s16.h): "s16.u<bits>" holds codes 0 .. 2^bits - 1,
// "s16.s<bits>" codes -2^(bits-1) .. 2^(bits-1) - 1 (bias 2^(bits-1)), bits 2-6;
// "q8_0.s5": q8_0 with codes -16..15 in 5 bits, "q8_0.nl4": q8_0 with
// codes from IQ4_NL's table as 4-bit indices (q8_packed.h).
void parse_qtype(LinearArgs& a, const std::string& s) {
  a.code_bits = 8;
  a.code_bias = 0;
  a.code_blocks = false;
  if (s == "q4_0") a.qtype = QType::Q4_0;
  else if (s == "q4_1") a.qtype = QType::Q4_1;
  else if (s == "q8_0") a.qtype = QType::Q8_0;
  else if (s == "q8_0.s5") {
    a.qtype = QType::Q8_0;
    a.code_bits = kQ8PackedBits;
    a.code_bias = kQ8PackedBias;
  } else if (s == "q8_0.nl4") {
    a.qtype = QType::Q8_0;
    a.code_bits = kQ8TableBits;
  } else if (s == "s16.u5b" || s == "s16.s5b") {  // per 32-block (q8_packed.h)
    a.qtype = QType::S16;
    a.code_bits = 5;
    a.code_bias = s[4] == 's' ? 1 << (a.code_bits - 1) : 0;
    a.code_blocks = true;
  } else if (s == "s16") a.qtype = QType::S16;
  else if (s.size() == 6 && s.compare(0, 4, "s16.") == 0 && (s[4] == 'u' || s[4] == 's') && s[5] >= '2' && s[5] <= '6') {
    a.qtype = QType::S16;
    a.code_bits = s[5] - '0';
    a.code_bias = s[4] == 's' ? 1 << (a.code_bits - 1) : 0;
  } else {
    fail("qtype", "'q4_0', 'q4_1', 'q8_0', 'q8_0.s5', 'q8_0.nl4', 's16' or packed s16 codes ('s16.u2' .. 's16.u6', "
         "'s16.s2' .. 's16.s6', 's16.u5b', 's16.s5b')",
         "'" + s + "'");
  }
}

attn::TensorArg matrix(const char* name, const Array& a, nb::dlpack::dtype want) { return tensor_of(name, a, want, 2); }

void require_shape(const attn::TensorArg& t, int64_t rows, int64_t cols, const std::string& why) {
  if (t.dim(0) != rows || t.dim(1) != cols)
    fail(t.name, "shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]",
         "shape " + t.shape_str() + " (" + why + ")");
}

bool absent(const std::optional<Array>& a) { return !a.has_value() || a->size() == 0; }

const nb::dlpack::dtype kFloat16{uint8_t(nb::dlpack::dtype_code::Float), 16, 1};

}  // namespace

std::string dtype_name(const nb::dlpack::dtype& t) {
  switch (nb::dlpack::dtype_code(t.code)) {
    case nb::dlpack::dtype_code::Int: return "int" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::UInt: return "uint" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Float: return "float" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Bfloat: return "bfloat" + std::to_string(t.bits);
    default: return "dtype code " + std::to_string(int(t.code)) + "/" + std::to_string(t.bits);
  }
}

attn::TensorArg tensor_of(const char* name, const Array& a, nb::dlpack::dtype want, size_t rank) {
  attn::TensorArg t = attn::any_tensor(name, a);
  if (a.dtype() != want) fail(name, "dtype " + dtype_name(want), "dtype " + dtype_name(a.dtype()));
  if (t.shape.size() != rank) fail(name, "a " + std::to_string(rank) + "-D tensor", "shape " + t.shape_str());
  return t;
}

// The packed weight: qs, d, m checked against each other; fills N, K and pointers.
void check_weight(LinearArgs& a, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m) {
  parse_qtype(a, qtype);
  const bool packed = a.code_bits != 8;  // packed codes: a row of groups of group_bytes
  const bool bytes = !packed && (a.qtype == QType::Q8_0 || a.qtype == QType::S16);  // one int8 code per weight
  const attn::TensorArg tq = matrix("qs", qs, bytes ? nb::dtype<int8_t>() : nb::dtype<uint8_t>());
  // packed codes come in groups: s16's of 256 weights (s16.h), q8_0's of 32 (q8_packed.h)
  const bool blocks = a.qtype == QType::Q8_0 || a.code_blocks;
  const int64_t group_bytes = q8_table(a) ? kBlock / 2 : blocks ? kQ8PackedBlockBytes : s16_packed_group_bytes(a.code_bits);
  const int64_t group = blocks ? kBlock : kS16PackedGroup;
  a.N = tq.dim(0);
  a.K = bytes ? tq.dim(1) : packed ? tq.dim(1) / group_bytes * group : 2 * tq.dim(1);
  if (a.N < 1 || a.K < kBlock || a.K % kBlock != 0 || (packed && tq.dim(1) % group_bytes != 0))
    fail("qs",
         std::string("N >= 1 rows and K a positive multiple of 32") +
             (bytes    ? ""
              : packed ? " (qs.shape[1] = K / " + std::to_string(group) + " * " + std::to_string(group_bytes) +
                             " for qtype '" + qtype + "')"
                       : " (K = 2 * qs.shape[1] for 4-bit types)"),
         "shape " + tq.shape_str() + ", K = " + std::to_string(a.K));
  const bool s16 = a.qtype == QType::S16;
  const int64_t groups = s16 ? a.K / kS16Half : a.blocks();
  const std::string per_group = s16 ? "one scale per 16 weights of each row" : "one scale per 32 weights of each row";
  a.qs = static_cast<const uint8_t*>(tq.data);
  a.d8 = a.m8 = nullptr;
  a.d16 = a.m16 = nullptr;
  if (s16 && d.dtype() == kFloat16) {  // half-pair scales (s16.h): widened by the drivers
    const std::string form = "fp16 half-pair scales: one per 32 weights of each row";
    const attn::TensorArg td = matrix("d", d, kFloat16);
    require_shape(td, a.N, a.blocks(), form);
    a.d16 = static_cast<const uint16_t*>(td.data);
    a.d = a.m = nullptr;  // the driver points them at the call's widened copy
    if (absent(m)) return;
    const attn::TensorArg tm = matrix("m", *m, kFloat16);
    require_shape(tm, a.N, a.blocks(), form);
    a.m16 = static_cast<const uint16_t*>(tm.data);
    return;
  }
  if (a.qtype != QType::Q4_1 && !s16 && !absent(m))  // float32 or compact scales alike
    fail("m", "None or empty for qtype '" + qtype + "' (it has no per-block offset)",
         "a tensor of " + std::to_string(m->size()) + " elements");
  // compact scales: Q4_K's (q4_1, with offsets), IQ4_XS's (q8_0), the s16 K-quants'
  const bool compact = a.qtype != QType::Q4_0 && d.dtype() == nb::dtype<uint8_t>();
  if (compact) {  // compact scales (compact_scales.h): widened by the drivers
    if (a.K % kCompactWeights)
      fail("d", "float32 scales for K not a multiple of 256 (compact scales have a float per 256 weights)",
           "uint8 compact scales");
    const std::string form = "compact scales: " + std::to_string(groups) + " bytes, then a float32 per 256 weights, "
                             "each row";
    const attn::TensorArg td = matrix("d", d, nb::dtype<uint8_t>());
    require_shape(td, a.N, compact_row_bytes(groups, a.K), form);
    a.d8 = static_cast<const uint8_t*>(td.data);
    a.d = a.m = nullptr;  // the driver points them at the call's widened copy
    if (absent(m)) {
      if (a.qtype == QType::Q4_1)
        fail("m", "compact offsets beside compact scales (qtype 'q4_1')", m ? "an empty tensor" : "None");
      return;
    }
    const attn::TensorArg tm = matrix("m", *m, nb::dtype<uint8_t>());
    require_shape(tm, a.N, compact_row_bytes(groups, a.K), form);
    a.m8 = static_cast<const uint8_t*>(tm.data);
    return;
  }
  const attn::TensorArg td = matrix("d", d, nb::dtype<float>());
  require_shape(td, a.N, groups, per_group);
  a.d = static_cast<const float*>(td.data);
  a.m = nullptr;
  if (a.qtype == QType::Q4_1 || (s16 && !absent(m))) {
    if (absent(m)) fail("m", "a tensor for qtype 'q4_1' (w = d * q + m)", m ? "an empty tensor" : "None");
    const attn::TensorArg tm = matrix("m", *m, nb::dtype<float>());
    require_shape(tm, a.N, groups, per_group);
    a.m = static_cast<const float*>(tm.data);
  }
}

namespace {

// x as the kernels read it: for the int16 path the two-term codes and block
// scales (quant_linear.h), and for q4_1 the exact fp32 block sums (both
// paths). Plain C++ on the calling thread, once per call, so every build and
// tiling sees the same values: fp32 divisions, std::fma for the residual and
// lrint (the default rounding mode rounds half to even).
struct QuantizedX {
  std::vector<int16_t> codes;  // [M, K/32, 2 * 32]: hi codes, then lo codes (int16 path)
  std::vector<float> scales;   // [M, K/32, 2]: s, s_lo (int16 path)
  std::vector<float> sums;     // [K/32, M], q4_1 only
};

// round_half_even(v / scale) clamped to +-kActMax; 0 for scale 0 or NaN.
int16_t int16_code(float v, float scale) {
  const float limit = float(kActMax);
  float q = scale > 0.f ? v / scale : 0.f;
  q = q > limit ? limit : (q < -limit ? -limit : (q == q ? q : 0.f));
  return int16_t(std::lrint(q));
}

// One block of 32 values into hi / lo codes; returns (s, s_lo).
//
// The residual x - s*hi is exact in fp32, so the fma returns it unrounded:
// if |x| >= s, x and s*hi are multiples of ulp(s) and |x - s*hi| <= s/2 (plus
// a hair from the rounded division) < 2^24 ulp(s); if |x| < s, hi is 0
// (residual x) or +-1 with fl(x/s) > 1/2, so s/2 < |x| < s and x - s is
// exact by Sterbenz's lemma. Only s_lo's resolution is then lost: s_lo/2 per
// element, s_lo at a tie |res| = s/2 whose lo code is clamped to 32767.
std::pair<float, float> quantize_block(const float* xb, int16_t* hi, int16_t* lo) {
  float amax = 0.f;
  for (int k = 0; k < kBlock; ++k) {
    const float v = std::fabs(xb[k]);
    amax = (v > amax || v != v) ? v : amax;  // a NaN sticks, so the output becomes NaN
  }
  const float s = amax / float(kActMax);
  const float s_lo = s * kLoScale;
  for (int k = 0; k < kBlock; ++k) {
    hi[k] = int16_code(xb[k], s);
    lo[k] = int16_code(std::fma(-s, float(hi[k]), xb[k]), s_lo);
  }
  return {s, s_lo};
}

QuantizedX prepare_x(const float* x, int64_t M, int64_t K, bool with_codes, bool with_sums) {
  const int64_t nb = K / kBlock;
  QuantizedX q{std::vector<int16_t>(with_codes ? size_t(M * nb * kXBlock) : 0),
               std::vector<float>(with_codes ? size_t(M * nb * 2) : 0),
               std::vector<float>(with_sums ? size_t(M * nb) : 0)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      if (with_codes) {
        int16_t* codes = q.codes.data() + (r * nb + b) * kXBlock;
        const auto [s, s_lo] = quantize_block(xb, codes, codes + kBlock);
        q.scales[size_t(2 * (r * nb + b))] = s;
        q.scales[size_t(2 * (r * nb + b) + 1)] = s_lo;
      }
      if (with_sums) {
        float lanes[kLanes];
        for (int l = 0; l < kLanes; ++l) lanes[l] = ((xb[l] + xb[8 + l]) + xb[16 + l]) + xb[24 + l];
        q.sums[size_t(b * M + r)] = hsum8(lanes);
      }
    }
  return q;
}

// The int8 paths: the rows of x quantized (int8.h; split over the threads by
// rows), then the weight rows in chunks of kI8ChunkRows split over the
// threads (balanced: a thread's chunks are consecutive, which the kernels'
// prefetch of the chunk after next relies on, and one done early takes the
// other's last chunks; parallel.h), each thread building its
// panels in its own scratch. Splitting N only: every model matrix has >= 18
// chunks, enough for the threads, and no panel is built twice.
//
// The quantized x lives in the calling thread's scratch, kept between calls
// (a fresh buffer per call costs a zero fill and page faults), with
// kI8PadRows readable rows past each code matrix (int8.h).
struct Int8Scratch {
  std::vector<int8_t> codes, lo;
  std::vector<float> scale, sums, scale_bm, sums_bm;
  std::vector<int32_t> corr, lo_corr, corr_bm;
  std::vector<int16_t> c16;
};

template <class V>
auto* at_least(V& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// Rows [0, two_rows) with int8x2's second term, rows [two_rows, M) as int8,
// or with `bf16_rest` in bfloat16 on AMX tiles made from each chunk's panel
// (bf16_prompt.h; the caller checked bf16_prompt_supported()).
void int8_linear(LinearArgs& a, int64_t two_rows, bool bf16_rest) {
  const int64_t K = a.K, N = a.N, nb = a.blocks();
  const int64_t M = bf16_rest ? two_rows : a.M;  // rows on the int8 kernels
  static thread_local Int8Scratch scratch;  // the caller's: its OpenMP team shares it for this call
  int8_t* const codes = at_least(scratch.codes, (M + kI8PadRows) * K);
  float* const scale = at_least(scratch.scale, M * nb);
  float* const sums = at_least(scratch.sums, M * nb);
  int32_t* const corr = at_least(scratch.corr, M * nb);
  int8_t* const lo = two_rows ? at_least(scratch.lo, (two_rows + kI8PadRows) * K) : nullptr;
  int32_t* const lo_corr = two_rows ? at_least(scratch.lo_corr, two_rows * nb) : nullptr;
  const Kernels kernels = active_kernels();
  // compact scales: each chunk widens its rows below
  const ItemWidener widen = item_widener(kernels);
  // packed q8_0 codes: each chunk unpacks its rows below
  const ItemCodes unpack = item_codes(kernels);
  const int64_t chunks = (N + kI8ChunkRows - 1) / kI8ChunkRows;
  const bool parallel = a.M * N * K >= kSerialMacs && (chunks > 1 || a.M > 1);
  // pair tiles (int8.h): the two-term rows' c as int16, when they are enough
  // rows for the build's pair tiles; PAGED_INT8_PAIRS=0 keeps the byte tiles
  // (for paired timings in one process, docs/cpu-linear.md)
  const char* pairs_env = std::getenv("PAGED_INT8_PAIRS");
  const bool pairs = kernels.pair_tiles && two_rows >= pair_min_rows(a.qtype) &&
                     !(pairs_env && std::string(pairs_env) == "0");
  int16_t* const c16 = pairs ? at_least(scratch.c16, two_rows * K) : nullptr;
  // Iteration i quantizes row r(i): the two-term rows (the first two_rows,
  // each twice the work) spread evenly over the iterations, so the static
  // split gives every thread its share of them (in row order they all went
  // to the first thread: ~2x its partner's low-term samples in a serving
  // profile of mixed steps).
  parallel_for(M, parallel, Schedule::Static, 1, [&](int64_t i) {
    const int64_t before = i * two_rows / M, after = (i + 1) * two_rows / M;  // two-term rows before i, i + 1
    const int64_t r = after > before ? before : two_rows + (i - before);
    kernels.x8_quantize(a.x + r * K, K, a.qtype, codes + r * K, scale + r * nb, corr + r * nb, sums + r * nb);
    if (r < two_rows)
      kernels.x8_low_term(a.x + r * K, K, a.qtype, codes + r * K, lo + r * K, scale + r * nb, lo_corr + r * nb,
                          sums + r * nb);
    if (c16 && r < two_rows) pair_codes(codes + r * K, lo + r * K, K, c16 + r * K);
  });
  // Block-major copies for the builds that read them (LinearArgs::x8_bm):
  // cheap beside the call (M x K/32 values against M x N x K products).
  LinearArgs::BlockMajor bm;
  if (kernels.block_major) {
    float* const scale_bm = at_least(scratch.scale_bm, M * nb);
    float* const sums_bm = at_least(scratch.sums_bm, M * nb);
    int32_t* const corr_bm = at_least(scratch.corr_bm, M * nb);
    parallel_for(nb, parallel, Schedule::Static, 1, [&](int64_t b) {
      for (int64_t r = 0; r < M; ++r) {
        scale_bm[b * M + r] = scale[r * nb + b];
        sums_bm[b * M + r] = sums[r * nb + b];
        corr_bm[b * M + r] = r < two_rows ? corr[r * nb + b] * 256 + lo_corr[r * nb + b] : corr[r * nb + b];
      }
    });
    bm = {scale_bm, sums_bm, corr_bm, M};
  }
  // The two row groups as two argument sets over the same weight chunk (the
  // second call finds the chunk's codes in cache).
  auto rows = [&](int64_t r0, int64_t r1, bool two_terms) {
    LinearArgs g = a;
    g.M = r1 - r0;
    g.x8 = codes + r0 * K;
    g.x8_scale = scale + r0 * nb;
    g.x8_corr = corr + r0 * nb;
    g.x8_sum = sums + r0 * nb;
    g.x8_lo = two_terms ? lo + r0 * K : nullptr;
    g.x8_lo_corr = two_terms ? lo_corr + r0 * nb : nullptr;
    g.x16 = two_terms ? c16 : nullptr;
    if (bm.scale) g.x8_bm = {bm.scale + r0, bm.sum + r0, bm.corr + r0, bm.ld};
    g.out = a.out + r0 * N;
    return g;
  };
  const LinearArgs two = rows(0, two_rows, true), one = rows(two_rows, M, false);
  // bfloat16 rows: packed once (bf16_prompt.h), then per chunk from the
  // panel the int8 rows just swept (in cache), so they add no weight stream.
  const Bf16Kernels* bf16 = bf16_rest ? bf16_prompt_rows() : nullptr;
  Bf16Args bf;
  if (bf16 && a.M > two_rows)
    bf = Bf16Args{a.M - two_rows, N, K, pack_bf16_rows(*bf16, a.x + two_rows * K, a.M - two_rows, K, parallel),
                  nullptr, a.out + two_rows * N};
  // packed q8_0 codes: unpacked per chunk for a build that does not read
  // their form (q8_reads_packed, q8_reads_table), and for the bf16 rows
  // (with panels qs is null: never)
  const bool reads_packed = q8_table(a) ? kernels.q8_reads_table : kernels.q8_reads_packed;
  const bool unpack_codes = (q8_packed(a) || q8_table(a)) && a.qs && (!reads_packed || bf.M);
  // the panels' crossover (int8.h) is chosen, and PAGED_NIBBLE_PANEL_ROWS
  // checked, on this thread: a ValueError cannot leave a worker
  if (a.panels) nibble_panel_rows();
  parallel_for(chunks, parallel, Schedule::Balanced, 1, [&](int64_t c) {
    // Each thread's panel keeps its capacity between calls (no allocation and
    // zeroing per call); the worker threads live as long as the process.
    static thread_local Int8Panel panel;
    panel.widened = nullptr;  // widened codes serve this chunk's row groups only
    const int64_t n0 = c * kI8ChunkRows, n1 = std::min(N, n0 + kI8ChunkRows);
    // compact scales widened here, or by the kernel as it transposes them
    const ItemScales sc = kernels.int8_reads_compact_scales ? ItemScales{a.d, a.m} : widen.rows(a, n0, n1);
    const LinearArgs codes_item = unpack_codes ? unpack.item(a, n0, n1) : a;
    const auto with_scales = [&](LinearArgs g, bool packed_read) {
      g.d = sc.d;
      g.m = sc.m;
      if (!packed_read) {
        g.qs = codes_item.qs;
        g.code_bits = codes_item.code_bits;
      }
      return g;
    };
    if (two.M) kernels.int8_rows(with_scales(two, reads_packed), n0, n1, panel);
    if (one.M) kernels.int8_rows(with_scales(one, reads_packed), n0, n1, panel);
    // the chunk's panel is in cache now (the int8 rows just swept it): its
    // bfloat16 tiles are made from it instead of read from a copy
    if (bf.M) bf16->panel_rows(bf, with_scales(a, false), n0, n1, panel);
  });
}

}  // namespace

Activations parse_activations(const std::string& s) {
  if (s == "float32") return Activations::Float32;
  if (s == "int8") return Activations::Int8;
  if (s == "int8x2") return Activations::Int8x2;
  fail("activations", "'float32', 'int8' or 'int8x2'", "'" + s + "'");
}

void int8_linear_checked(LinearArgs& a, int64_t two_rows) {
  if (a.qtype == QType::S16) return s16_linear(a, two_rows);
  return int8_linear(a, two_rows, false);
}

Kernels active_kernels() { return linear_selector().active().kernel; }
const char* current_isa() { return linear_selector().active().name; }
void set_isa(const std::string& name) { linear_selector().set(name); }
std::vector<std::string> supported_isas() { return linear_selector().supported(); }

// The packed arrays' pointers are nulled: with panels they are never read.
void use_panels(LinearArgs& a, const Array& panels) {
  a.panels = check_panels(a, panels);
  a.panel_offsets = a.has_offsets();
  a.qs = nullptr;
  a.d = a.m = nullptr;
  a.d8 = a.m8 = nullptr;
}

void quant_linear(const Array& x, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m, const Array& out, const std::string& activations,
                  int64_t two_term_rows, const std::optional<Array>& panels, const std::string& prompt_rows) {
  const Activations act = parse_activations(activations);
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  const attn::TensorArg tx = matrix("x", x, nb::dtype<float>());
  a.M = tx.dim(0);
  if (a.M < 1) fail("x", "at least one row", "shape " + tx.shape_str());
  require_shape(tx, a.M, a.K, "x is [M, K] with K the weight's input size");
  const attn::TensorArg to = matrix("out", out, nb::dtype<float>());
  require_shape(to, a.M, a.N, "out is [M, N] with N the weight's output size");
  a.out = static_cast<float*>(to.data);
  a.x = static_cast<const float*>(tx.data);
  if (two_term_rows < -1 || (two_term_rows >= 0 && act != Activations::Int8x2))
    fail("two_term_rows", "-1 (all rows), or >= 0 with activations 'int8x2'",
         std::to_string(two_term_rows) + " with activations '" + activations + "'");
  if (prompt_rows != "int8" && prompt_rows != "bf16")
    fail("prompt_rows", "'int8' or 'bf16'", "'" + prompt_rows + "'");
  const bool bf16_rest = prompt_rows == "bf16";
  if (bf16_rest && act != Activations::Int8x2)
    fail("prompt_rows", "'int8' with activations '" + activations + "' ('bf16' is int8x2's)", "'bf16'");
  if (bf16_rest && !bf16_prompt_supported())
    fail("prompt_rows", "'int8' on this CPU (no AMX-BF16 tiles: bf16_prompt_supported() is False)", "'bf16'");
  if (a.qtype == QType::S16) {
    if (act == Activations::Float32)
      fail("activations", "'int8' or 'int8x2' for qtype 's16' (float32 activations dequantize it: quant_dequantize)",
           "'float32'");
    if (bf16_rest) fail("prompt_rows", "'int8' for qtype 's16' (its bfloat16 tiles come from q4/q8 panels)", "'bf16'");
    if (panels) use_panels(a, *panels);
    nb::gil_scoped_release no_gil;
    return s16_linear(a, act == Activations::Int8 ? 0 : (two_term_rows < 0 ? a.M : std::min(two_term_rows, a.M)));
  }
  if (panels && act != Activations::Float32) use_panels(a, *panels);  // float32 ignores them
  nb::gil_scoped_release no_gil;
  if (act != Activations::Float32)
    return int8_linear(a, act == Activations::Int8 ? 0 : (two_term_rows < 0 ? a.M : std::min(two_term_rows, a.M)),
                       bf16_rest);
  const bool int16_path = a.M <= kInt16MaxRows;
  const QuantizedX qx = prepare_x(a.x, a.M, a.K, int16_path, a.qtype == QType::Q4_1);
  a.xq = qx.codes.data();
  a.xscale = qx.scales.data();
  a.xs = qx.sums.data();

  const Kernels kernels = active_kernels();
  const RowsKernel kernel = int16_path ? kernels.int16_rows : kernels.fp32_rows;
  const int64_t chunks = (a.N + kRowsPerChunk - 1) / kRowsPerChunk;
  const bool parallel = a.M * a.N * a.K >= kSerialMacs && chunks > 1;
  // compact scales: each chunk widens its rows
  const ItemWidener widen = item_widener(kernels);
  const ItemCodes unpack = item_codes(kernels);  // packed q8_0 codes, per chunk
  parallel_for(chunks, parallel, Schedule::Balanced, 1, [&](int64_t c) {
    static thread_local std::vector<float> scratch;
    const int64_t n0 = c * kRowsPerChunk, n1 = std::min(a.N, (c + 1) * kRowsPerChunk);
    kernel(widen.item(unpack.item(a, n0, n1), n0, n1), n0, n1, scratch);
  });
}

void pack_codes(const Array& codes, const std::string& qtype, const Array& out) {
  LinearArgs a;
  parse_qtype(a, qtype);
  if (a.code_bits == 8)
    fail("qtype",
         "a packed form ('q8_0.s5', 'q8_0.nl4', 's16.u2' .. 's16.u6', 's16.s2' .. 's16.s6', 's16.u5b', 's16.s5b')",
         "'" + qtype + "'");
  const bool blocks = a.qtype == QType::Q8_0 || a.code_blocks;  // q8_packed.h's form
  const int64_t group = blocks ? kBlock : kS16PackedGroup;  // weights per group of packed codes
  const attn::TensorArg tc = matrix("codes", codes, nb::dtype<int8_t>());
  a.N = tc.dim(0);
  a.K = tc.dim(1);
  if (a.N < 1 || a.K < group || a.K % group)
    fail("codes", "[N >= 1, K] with K a positive multiple of " + std::to_string(group) + " (packed codes come in "
                      "groups of " + std::to_string(group) + ")",
         "shape " + tc.shape_str());
  const attn::TensorArg to = matrix("out", out, nb::dtype<uint8_t>());
  require_shape(to, a.N, a.row_bytes(), "the packed rows of qtype '" + qtype + "'");
  const auto* c = static_cast<const int8_t*>(tc.data);
  auto* dst = static_cast<uint8_t*>(to.data);
  const int bits = a.code_bits, bias = a.code_bias, lo = -bias, hi = (1 << bits) - 1 - bias;
  int64_t bad = -1;
  {
    nb::gil_scoped_release no_gil;
#pragma omp parallel for schedule(static) reduction(max : bad)
    for (int64_t n = 0; n < a.N; ++n) {
      for (int64_t k = 0; k < a.K; ++k)
        if (q8_table(a) ? table4_index(c[n * a.K + k]) < 0 : c[n * a.K + k] < lo || c[n * a.K + k] > hi)
          bad = std::max(bad, n * a.K + k);
      if (q8_table(a)) pack_table4_row(c + n * a.K, a.K, dst + n * a.row_bytes());  // (bad says where it stopped)
      else if (blocks) pack_block5_row(c + n * a.K, a.K, bias, dst + n * a.row_bytes());
      else pack_s16_row(c + n * a.K, a.K, bits, bias, dst + n * a.row_bytes());
    }
  }
  if (bad >= 0)
    fail("codes",
         (q8_table(a) ? std::string("codes among IQ4_NL's 16 values")
                      : "codes in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]") +
             " for qtype '" + qtype + "'",
         "code " + std::to_string(int(c[bad])) + " at [" + std::to_string(bad / a.K) + ", " +
             std::to_string(bad % a.K) + "]");
}

// Separate multiply and add, as gguf does (this file is built without FMA, so
// the compiler cannot fuse them).
void quant_dequantize(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m,
                      const Array& out) {
  LinearArgs a;
  check_weight(a, qtype, qs, d, m);
  const attn::TensorArg to = matrix("out", out, nb::dtype<float>());
  require_shape(to, a.N, a.K, "out is the dense [N, K] weight");
  float* w = static_cast<float*>(to.data);
  const int64_t nb = a.blocks();
  nb::gil_scoped_release no_gil;
  // compact scales: all rows, before the parallel loop
  widen_all_rows(a, active_kernels());
  if (a.qtype == QType::S16) return s16_dequantize(a, w);
  const ItemCodes unpack = item_codes(active_kernels());
  // Rows in parallel (prefill dequantizes a matrix per call); built for the
  // baseline ISA, so scale * q + offset is never contracted into an FMA and
  // the values stay exactly gguf's.
#pragma omp parallel for schedule(static) if (a.N * a.K >= kSerialMacs)
  for (int64_t n = 0; n < a.N; ++n) {
    const LinearArgs r = unpack.item(a, n, n + 1);  // packed q8_0: the row unpacked
    const uint8_t* row = r.qs + n * r.row_bytes();
    int codes[kBlock];
    for (int64_t b = 0; b < nb; ++b) {
      for (int k = 0; k < kBlock; ++k) codes[k] = block_code(a.qtype, row, b, k);
      const float scale = a.d[n * nb + b];
      float* dst = w + n * a.K + b * kBlock;
      if (a.m) {
        const float offset = a.m[n * nb + b];
        for (int k = 0; k < kBlock; ++k) dst[k] = scale * float(codes[k]) + offset;
      } else {
        for (int k = 0; k < kBlock; ++k) dst[k] = scale * float(codes[k]);
      }
    }
  }
}

}  // namespace paged::cpu::linear
