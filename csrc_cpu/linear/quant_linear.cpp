// Boundary checks, the choice of path (activations "int8"/"int8x2", else int16 or fp32
// by M; quant_linear.h, int8.h), the quantization of x, the split over weight
// rows (parallel_for: OpenMP, or the std::thread pool without it) and the ISA
// choice for the quantized linear; the per-ISA kernels do the arithmetic.
#include "linear/ops.h"
#include "kernel_builds.h"

#include "runtime/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <utility>

#include "attention/tensor_args.h"
#include "linear/int8.h"

namespace nb = nanobind;

namespace paged::cpu::linear {
namespace {

using attn::fail;

constexpr int64_t kRowsPerChunk = 24;  // weight rows per OpenMP work item (whole AVX2 register tiles)
constexpr int64_t kSerialMacs = int64_t(1) << 16;  // below this, stay on the calling thread

QType parse_qtype(const std::string& s) {
  if (s == "q4_0") return QType::Q4_0;
  if (s == "q4_1") return QType::Q4_1;
  if (s == "q8_0") return QType::Q8_0;
  fail("qtype", "'q4_0', 'q4_1' or 'q8_0'", "'" + s + "'");
}

std::string dtype_str(const nb::dlpack::dtype& t) {
  switch (nb::dlpack::dtype_code(t.code)) {
    case nb::dlpack::dtype_code::Int: return "int" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::UInt: return "uint" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Float: return "float" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Bfloat: return "bfloat" + std::to_string(t.bits);
    default: return "dtype code " + std::to_string(int(t.code)) + "/" + std::to_string(t.bits);
  }
}

// A contiguous CPU tensor of the given dtype and rank 2.
attn::TensorArg matrix(const char* name, const Array& a, nb::dlpack::dtype want) {
  attn::TensorArg t = attn::any_tensor(name, a);
  if (a.dtype() != want)
    fail(name, "dtype " + dtype_str(want), "dtype " + dtype_str(a.dtype()));
  if (t.shape.size() != 2) fail(name, "a 2-D tensor", "shape " + t.shape_str());
  return t;
}

void require_shape(const attn::TensorArg& t, int64_t rows, int64_t cols, const std::string& why) {
  if (t.dim(0) != rows || t.dim(1) != cols)
    fail(t.name, "shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]",
         "shape " + t.shape_str() + " (" + why + ")");
}

bool absent(const std::optional<Array>& a) { return !a.has_value() || a->size() == 0; }

// The packed weight: qs, d, m checked against each other; fills N, K and pointers.
void check_weight(LinearArgs& a, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m) {
  a.qtype = parse_qtype(qtype);
  const bool q8 = a.qtype == QType::Q8_0;
  const attn::TensorArg tq = matrix("qs", qs, q8 ? nb::dtype<int8_t>() : nb::dtype<uint8_t>());
  a.N = tq.dim(0);
  a.K = q8 ? tq.dim(1) : 2 * tq.dim(1);
  if (a.N < 1 || a.K < kBlock || a.K % kBlock != 0)
    fail("qs",
         std::string("N >= 1 rows and K a positive multiple of 32") +
             (q8 ? "" : " (K = 2 * qs.shape[1] for 4-bit types)"),
         "shape " + tq.shape_str() + ", K = " + std::to_string(a.K));
  const std::string per_block = "one scale per 32 weights of each row";
  const attn::TensorArg td = matrix("d", d, nb::dtype<float>());
  require_shape(td, a.N, a.blocks(), per_block);
  a.qs = static_cast<const uint8_t*>(tq.data);
  a.d = static_cast<const float*>(td.data);
  a.m = nullptr;
  if (a.qtype == QType::Q4_1) {
    if (absent(m)) fail("m", "a tensor for qtype 'q4_1' (w = d * q + m)", m ? "an empty tensor" : "None");
    const attn::TensorArg tm = matrix("m", *m, nb::dtype<float>());
    require_shape(tm, a.N, a.blocks(), per_block);
    a.m = static_cast<const float*>(tm.data);
  } else if (!absent(m)) {
    fail("m", "None or empty for qtype '" + qtype + "' (it has no per-block offset)",
         "a tensor of " + std::to_string(m->size()) + " elements");
  }
}

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

// The builds of this architecture, best first (kernel_builds.cpp).
IsaSelector<Kernels>& selector() {
  static IsaSelector<Kernels> s(linear_builds(), "linear");
  return s;
}

// The int8 paths: the rows of x quantized (int8.h; split over the threads by
// rows), then the weight rows in chunks of kI8ChunkRows split over the
// threads (static: a thread's chunks are consecutive, which the kernels'
// prefetch of the chunk after next relies on), each thread building its
// panels in its own scratch. Splitting N only: every model matrix has >= 18
// chunks, enough for the threads, and no panel is built twice.
//
// With `terms` = 2 (int8x2), row r of x becomes two rows of codes for the
// kernels: its quantization (xq, dx), then that of the residual
// x - dx * xq (one fp32 multiply, one subtraction: this file is compiled
// without FMA contraction). The kernels compute each term's outputs as for
// any row (sharing the weight unpacking), and out[r] = term 0 + term 1, one
// fp32 addition: a row's bits still depend on that row alone.
//
// The quantized x and the terms' outputs live in the calling thread's
// scratch, kept between calls: a fresh buffer per call costs a zero fill and
// page faults (the lm_head's outputs at 64 rows are 25 MB in int8x2 mode).
struct Int8Scratch {
  std::vector<int8_t> codes;
  std::vector<float> scale, sums, parts;
  std::vector<int32_t> corr;
};

template <class V>
auto* at_least(V& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

void int8_linear(LinearArgs& a, int64_t terms) {
  const int64_t M = a.M, K = a.K, N = a.N, nb = a.blocks(), rows = M * terms;
  static thread_local Int8Scratch scratch;  // the caller's: its OpenMP team shares it for this call
  int8_t* const codes = at_least(scratch.codes, rows * K);
  float* const scale = at_least(scratch.scale, rows * nb);
  float* const sums = at_least(scratch.sums, rows * nb);
  int32_t* const corr = at_least(scratch.corr, rows * nb);
  float* const parts = terms > 1 ? at_least(scratch.parts, rows * N) : nullptr;  // each term's outputs
  LinearArgs k = a;  // what the kernels see: `rows` rows of codes
  k.M = rows;
  k.x8 = codes;
  k.x8_scale = scale;
  k.x8_corr = corr;
  k.x8_sum = sums;
  if (terms > 1) k.out = parts;
  const Kernels kernels = active_kernels();
  const Int8Kernel kernel = kernels.int8_rows;
  const int64_t chunks = (N + kI8ChunkRows - 1) / kI8ChunkRows;
  const bool parallel = rows * N * K >= kSerialMacs && (chunks > 1 || rows > 1);
  const auto quantize = [&](const float* x, int64_t row) {
    kernels.x8_quantize(x, K, a.qtype, codes + row * K, scale + row * nb, corr + row * nb, sums + row * nb);
  };
#pragma omp parallel if (parallel)
  {
    std::vector<float> residual(terms > 1 ? size_t(K) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r) {
      const float* x = a.x + r * K;
      quantize(x, r * terms);
      if (terms == 1) continue;
      const int8_t* q = codes + r * terms * K;
      const float* dx = scale + r * terms * nb;
      for (int64_t i = 0; i < K; ++i) residual[size_t(i)] = x[i] - dx[i / kBlock] * float(q[i]);
      quantize(residual.data(), r * terms + 1);
    }
    // Each thread's panel keeps its capacity between calls (no allocation and
    // zeroing per call); OpenMP's worker threads live as long as the process.
    static thread_local Int8Panel panel;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) kernel(k, c * kI8ChunkRows, std::min(N, (c + 1) * kI8ChunkRows), panel);
    if (terms > 1) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < N; ++n) a.out[r * N + n] = parts[2 * r * N + n] + parts[(2 * r + 1) * N + n];
    }
  }
}

}  // namespace

Activations parse_activations(const std::string& s) {
  if (s == "float32") return Activations::Float32;
  if (s == "int8") return Activations::Int8;
  if (s == "int8x2") return Activations::Int8x2;
  fail("activations", "'float32', 'int8' or 'int8x2'", "'" + s + "'");
}

Kernels active_kernels() { return selector().active().kernel; }
const char* current_isa() { return selector().active().name; }
void set_isa(const std::string& name) { selector().set(name); }
std::vector<std::string> supported_isas() { return selector().supported(); }

void quant_linear(const Array& x, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m, const Array& out, const std::string& activations) {
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
  nb::gil_scoped_release no_gil;
  if (act != Activations::Float32) return int8_linear(a, act == Activations::Int8x2 ? 2 : 1);
  const bool int16_path = a.M <= kInt16MaxRows;
  const QuantizedX qx = prepare_x(a.x, a.M, a.K, int16_path, a.qtype == QType::Q4_1);
  a.xq = qx.codes.data();
  a.xscale = qx.scales.data();
  a.xs = qx.sums.data();

  const Kernels kernels = active_kernels();
  const RowsKernel kernel = int16_path ? kernels.int16_rows : kernels.fp32_rows;
  const int64_t chunks = (a.N + kRowsPerChunk - 1) / kRowsPerChunk;
  const bool parallel = a.M * a.N * a.K >= kSerialMacs && chunks > 1;
  parallel_for(chunks, parallel, Schedule::Static, 1, [&](int64_t c) {
    static thread_local std::vector<float> scratch;
    kernel(a, c * kRowsPerChunk, std::min(a.N, (c + 1) * kRowsPerChunk), scratch);
  });
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
  // Rows in parallel (prefill dequantizes a matrix per call); built for the
  // baseline ISA, so scale * q + offset is never contracted into an FMA and
  // the values stay exactly gguf's.
#pragma omp parallel for schedule(static) if (a.N * a.K >= kSerialMacs)
  for (int64_t n = 0; n < a.N; ++n) {
    const uint8_t* row = a.qs + n * a.row_bytes();
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
