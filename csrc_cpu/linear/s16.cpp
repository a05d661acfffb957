// The s16 layout's int8 paths (s16.h): x quantized with the active build's
// int8 quantizer, the half sums for weights with offsets, then the weight
// rows in chunks over the threads (packed codes unpacked per work item
// where the kernel does not read them). The plain C++ kernel, the definition
// every build matches bit for bit, is kernel_s16_scalar.cpp.
#include "linear/s16.h"

#include "linear/compact_scales.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "runtime/parallel.h"

namespace paged::cpu::linear {
namespace {

struct S16Scratch {
  std::vector<int8_t> codes, lo;
  std::vector<int16_t> c16;
  std::vector<float> scale, sums, half;
  std::vector<int32_t> corr, lo_corr, half_bias;
};

template <class V>
auto* grow(V& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

// Per half h of a row (codes hi, and lo for int8x2; scale dx per 32-block):
// the sum of its codes c, as xs[h] = fl(dx[h/2] * float(sum)) (s16.h; when
// xs is given) and bias * sum (when bias is given).
void half_sums(const int8_t* hi, const int8_t* lo, const float* dx, int code_bias, int64_t K, float* xs, int32_t* bias) {
  for (int64_t h = 0; h < K / kS16Half; ++h) {
    int32_t sum = 0;
    for (int64_t k = h * kS16Half; k < (h + 1) * kS16Half; ++k) sum += lo ? hi[k] * 256 + lo[k] : hi[k];
    if (xs) xs[h] = dx[h / 2] * float(sum);
    if (bias) bias[h] = code_bias * sum;
  }
}

}  // namespace

S16Kernel s16_kernel() {
  const S16Kernel k = active_kernels().s16_rows;
  return k ? k : isa_scalar::s16_rows;
}

namespace {

// Weight rows per unpacking of packed codes in calls of few rows: they stay
// in L1 between the unpacking and the kernel (larger calls unpack the work
// item's rows at once: its register tiles sweep them once per x-row tile).
constexpr int64_t kFewRowsUnpack = 4;

// kernel(s, n0, n1) on int8 codes: a.qs as it lies, or packed codes
// unpacked into this thread's scratch (a worker's own: each unpacks the
// rows it runs), unless the kernel reads them itself (`reads_packed`).
void run_rows(S16Kernel kernel, S16Unpack unpack, Block5Unpack unpack5, bool reads_packed, S16Args s, int64_t n0,
              int64_t n1) {
  const LinearArgs& a = *s.a;
  if (a.code_bits == 8) s.codes = reinterpret_cast<const int8_t*>(a.qs);
  if (a.code_bits == 8 || reads_packed) return kernel(s, n0, n1);
  static thread_local std::vector<int8_t> rows;
  LinearArgs bytes = a;  // what the kernel reads: the unpacked rows, as byte codes
  bytes.code_bits = 8;
  bytes.code_bias = 0;
  bytes.code_blocks = false;
  s.a = &bytes;
  const int64_t step = a.M <= kS16FewRows ? kFewRowsUnpack : n1 - n0;
  if (rows.size() < size_t(step * a.K)) rows.resize(size_t(step * a.K));
  for (int64_t n = n0; n < n1; n += step) {
    const int64_t end = std::min(n1, n + step);
    if (a.code_blocks) unpack5(a.qs + n * a.row_bytes(), a.K, a.code_bias, end - n, rows.data());
    else unpack(a.qs + n * a.row_bytes(), a.K, a.code_bits, a.code_bias, end - n, rows.data());
    s.codes = rows.data();
    s.codes_row0 = n;
    kernel(s, n, end);
  }
}

}  // namespace

void s16_linear(LinearArgs& a, int64_t two_rows) {
  const int64_t K = a.K, M = a.M, nb = a.blocks(), nh = K / kS16Half;
  static thread_local S16Scratch scratch;  // the caller's: its team shares it for this call
  int8_t* const codes = grow(scratch.codes, M * K);
  float* const scale = grow(scratch.scale, M * nb);
  float* const sums = grow(scratch.sums, M * nb);
  int32_t* const corr = grow(scratch.corr, M * nb);
  int8_t* const lo = two_rows ? grow(scratch.lo, two_rows * K) : nullptr;
  int32_t* const lo_corr = two_rows ? grow(scratch.lo_corr, two_rows * nb) : nullptr;
  const Kernels kernels = active_kernels();
  // compact scales: each chunk widens its rows below
  const ItemWidener widen = item_widener(kernels);
  float* const half = a.has_offsets() ? grow(scratch.half, M * nh) : nullptr;  // offsets (compact: widened per item)
  const bool parallel = M * a.N * K >= kSerialMacs;
  // per row group (s16.h): packed codes read in place, the bias of its half sums, c16
  const auto reads_packed = [&](int64_t rows) { return s16_reads_packed(kernels, a, rows); };
  const auto group_bias = [&](int64_t rows, bool two_terms) { return s16_group_bias(kernels, a, rows, two_terms); };
  const auto reads_c16 = [&](int64_t rows, bool two_terms) { return s16_reads_c16(kernels, a, rows, two_terms); };
  const int64_t one_rows = M - two_rows;  // the rows without the low term
  int16_t* const c16 = reads_c16(two_rows, true) || reads_c16(one_rows, false) ? grow(scratch.c16, M * K) : nullptr;
  int32_t* const half_bias =
      group_bias(two_rows, true) || group_bias(one_rows, false) ? grow(scratch.half_bias, M * nh) : nullptr;
  // the codes and scales do not depend on the weight's type: q8_0's quantizer (its corr and sums go unused)
  parallel_for(M, parallel, Schedule::Static, 1, [&](int64_t r) {
    kernels.x8_quantize(a.x + r * K, K, QType::Q8_0, codes + r * K, scale + r * nb, corr + r * nb, sums + r * nb);
    if (r < two_rows)
      kernels.x8_low_term(a.x + r * K, K, QType::Q8_0, codes + r * K, lo + r * K, scale + r * nb, lo_corr + r * nb,
                          sums + r * nb);
    const bool two = r < two_rows;
    const int64_t group = two ? two_rows : one_rows;
    if (reads_c16(group, two)) pair_codes(codes + r * K, two ? lo + r * K : nullptr, K, c16 + r * K);
    const int32_t bias = group_bias(group, two);
    if (half || bias)
      half_sums(codes + r * K, two ? lo + r * K : nullptr, scale + r * nb, bias, K, half ? half + r * nh : nullptr,
                bias ? half_bias + r * nh : nullptr);
  });
  const S16Kernel kernel = s16_kernel();
  const S16Unpack unpack = kernels.s16_unpack ? kernels.s16_unpack : unpack_s16_rows;
  const Block5Unpack unpack5 = kernels.block5_unpack ? kernels.block5_unpack : unpack_block5_rows;
  auto run = [&](int64_t r0, int64_t r1, bool two_terms) {
    if (r1 <= r0) return;
    LinearArgs g = a;
    g.M = r1 - r0;
    g.x8 = codes + r0 * K;
    g.x8_lo = two_terms ? lo + r0 * K : nullptr;
    g.x8_scale = scale + r0 * nb;
    g.out = a.out + r0 * a.N;
    const bool packed_rows = reads_packed(g.M);
    S16Args s{&g, half ? half + r0 * nh : nullptr, group_bias(g.M, two_terms) ? half_bias + r0 * nh : nullptr,
              reads_c16(g.M, two_terms) ? c16 + r0 * K : nullptr};
    const int64_t chunks = (a.N + kI8ChunkRows - 1) / kI8ChunkRows;
    parallel_for(chunks, parallel && chunks > 1, Schedule::Balanced, 1, [&](int64_t c) {
      const int64_t n0 = c * kI8ChunkRows, n1 = std::min(a.N, (c + 1) * kI8ChunkRows);
      if (a.panels) return kernel(s, n0, n1);  // persistent panels: the build's kernel reads them itself
      // compact scales widened here, or by the few-rows kernel in registers
      // (compact scales and fp16 half pairs alike)
      const bool compact_read = kernels.s16_few_rows_reads_compact && g.M <= kS16FewRows;
      const LinearArgs item = compact_read ? g : widen.item(g, n0, n1);
      S16Args si = s;
      si.a = &item;
      run_rows(kernel, unpack, unpack5, packed_rows, si, n0, n1);
    });
  };
  run(0, two_rows, true);
  run(two_rows, M, false);
}

void s16_dequantize(const LinearArgs& a, float* out) {
  const int64_t K = a.K, nh = K / kS16Half;
#pragma omp parallel for schedule(static) if (a.N * K >= kSerialMacs)
  for (int64_t n = 0; n < a.N; ++n) {
    static thread_local std::vector<int8_t> row;
    const int8_t* codes = reinterpret_cast<const int8_t*>(a.qs) + n * K;
    if (a.code_bits != 8) {
      if (row.size() < size_t(K)) row.resize(size_t(K));
      if (a.code_blocks) unpack_block5_rows(a.qs + n * a.row_bytes(), K, a.code_bias, 1, row.data());
      else unpack_s16_rows(a.qs + n * a.row_bytes(), K, a.code_bits, a.code_bias, 1, row.data());
      codes = row.data();
    }
    for (int64_t k = 0; k < K; ++k) {
      const float w = a.d[n * nh + k / kS16Half] * float(codes[k]);
      out[n * K + k] = a.m ? w + a.m[n * nh + k / kS16Half] : w;
    }
  }
}

}  // namespace paged::cpu::linear
