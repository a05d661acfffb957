// Every quantized-linear build of this architecture (kernel_builds.h) against
// the scalar build, bit for bit (the contract of quant_linear.h and int8.h:
// one order of operations per output in every build): the int16 path
// (M <= kInt16MaxRows), the fp32 path, and the int8 path with its quantizer
// of x, for q4_0 / q4_1 / q8_0, output counts that leave partial tiles;
// and the s16 layout's kernel on int8 and on packed codes (check_s16), q8_0's
// and s16's 5-bit codes packed per 32-block, with fp16 half-pair scales
// (check_packed_blocks);
// on x86-64, the persistent panels in every scale form (check_panel_forms).
// The int16 inputs are random valid codes and scales rather than a
// quantization of x: the kernels must agree on any such input.
// Built natively by tests/test_kernel_drivers.py, cross-built and run under
// qemu-aarch64 by .ci/arm_emulation.sh.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernel_builds.h"
#include "linear/aligned.h"
#include "linear/compact_scales.h"
#include "linear/int8.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"
#if defined(PAGED_ISA_X86)
#include "arch/x86/linear/int8_avx512.h"
#endif
#include "tests/driver_util.h"

namespace {

using namespace paged::cpu;
using namespace paged::cpu::linear;
using namespace paged::cpu::test;

constexpr int64_t kRowsPerChunk = 24;  // the float32 paths' work item (quant_linear.cpp)

struct Weight {
  QType qtype;
  int64_t N, K;
  std::vector<uint8_t> qs;
  std::vector<float> d, m;
};

Weight random_weight(QType t, int64_t N, int64_t K) {
  Weight w{t, N, K, {}, {}, {}};
  w.qs.resize(size_t(N * (t == QType::Q8_0 ? K : K / 2)));
  for (uint8_t& b : w.qs) b = uint8_t(uniform_int(0, 255));
  if (t == QType::Q8_0)  // gguf's q8_0 codes are in [-127, 127]
    for (uint8_t& b : w.qs) b = b == 0x80 ? 0x81 : b;
  for (int64_t i = 0; i < N * K / kBlock; ++i) w.d.push_back(uniform(-0.02f, 0.02f));
  if (t == QType::Q4_1)
    for (int64_t i = 0; i < N * K / kBlock; ++i) w.m.push_back(uniform(-0.1f, 0.1f));
  return w;
}

// x and everything the kernels read about it, for both float32 paths and the int8 one.
struct X {
  int64_t M;
  std::vector<float> x, xscale, xs;
  std::vector<int16_t> xq;
  std::vector<int8_t> x8, x8_lo;
  std::vector<float> x8_scale, x8_sum;
  std::vector<int32_t> x8_corr, x8_lo_corr;
};

X random_x(const Weight& w, int64_t M, Int8Quantize quantize) {
  const int64_t nb = w.K / kBlock;
  X x{M, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  for (int64_t i = 0; i < M * w.K; ++i) x.x.push_back(uniform(-2.f, 2.f));
  for (int64_t i = 0; i < M * nb * kXBlock; ++i) x.xq.push_back(int16_t(uniform_int(-kActMax, kActMax)));
  for (int64_t i = 0; i < M * nb; ++i) {
    const float s = uniform(1e-5f, 1e-4f);
    x.xscale.push_back(s);
    x.xscale.push_back(s * kLoScale);
  }
  for (int64_t i = 0; i < M * nb; ++i) x.xs.push_back(uniform(-8.f, 8.f));
  x.x8.resize(size_t((M + kI8PadRows) * w.K));  // int8.h: rows past M readable
  x.x8_scale.resize(size_t(M * nb));
  x.x8_sum.resize(size_t(M * nb));
  x.x8_corr.resize(size_t(M * nb));
  for (int64_t r = 0; r < M; ++r)
    quantize(x.x.data() + r * w.K, w.K, w.qtype, x.x8.data() + r * w.K, x.x8_scale.data() + r * nb,
             x.x8_corr.data() + r * nb, x.x8_sum.data() + r * nb);
  // int8x2's low codes (any in [-127, 127]) and their corr: the kernels' part
  // of that path (the low quantization itself is quant_linear.cpp's, one for all builds).
  for (int64_t i = 0; i < M * w.K; ++i) x.x8_lo.push_back(int8_t(uniform_int(-kI8Max, kI8Max)));
  x.x8_lo.resize(size_t((M + kI8PadRows) * w.K));
  for (int64_t i = 0; i < M * nb; ++i) {
    int32_t sum = 0;
    for (int k = 0; k < kBlock; ++k) sum += x.x8_lo[size_t(i * kBlock + k)];
    x.x8_lo_corr.push_back(-unsigned_offset(w.qtype) * sum);
  }
  return x;
}

LinearArgs args(const Weight& w, const X& x, std::vector<float>& out) {
  LinearArgs a;
  a.qtype = w.qtype;
  a.M = x.M;
  a.N = w.N;
  a.K = w.K;
  a.x = x.x.data();
  a.xq = x.xq.data();
  a.xscale = x.xscale.data();
  a.qs = w.qs.data();
  a.d = w.d.data();
  a.m = w.m.empty() ? nullptr : w.m.data();
  a.xs = x.xs.data();
  a.x8 = x.x8.data();
  a.x8_scale = x.x8_scale.data();
  a.x8_corr = x.x8_corr.data();
  a.x8_sum = x.x8_sum.data();
  out.assign(size_t(x.M * w.N), NAN);
  a.out = out.data();
  return a;
}

enum class Path { Int16, Fp32, Int8, Int8x2 };
const char* path_name(Path p) {
  switch (p) {
    case Path::Int16: return "int16";
    case Path::Fp32: return "fp32";
    case Path::Int8: return "int8";
    default: return "int8x2";
  }
}

std::vector<float> run(const Kernels& k, Path p, const Weight& w, const X& x) {
  std::vector<float> out;
  LinearArgs a = args(w, x, out);
  if (p == Path::Int8x2) {
    a.x8_lo = x.x8_lo.data();
    a.x8_lo_corr = x.x8_lo_corr.data();
  }
  // the block-major copies (LinearArgs::x8_bm), as quant_linear.cpp makes them
  const int64_t nb = w.K / kBlock;
  std::vector<float> scale_bm(size_t(x.M * nb)), sum_bm(scale_bm.size());
  std::vector<int32_t> corr_bm(scale_bm.size());
  for (int64_t r = 0; r < x.M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      scale_bm[size_t(b * x.M + r)] = x.x8_scale[size_t(r * nb + b)];
      sum_bm[size_t(b * x.M + r)] = x.x8_sum[size_t(r * nb + b)];
      const int32_t corr = x.x8_corr[size_t(r * nb + b)];
      corr_bm[size_t(b * x.M + r)] = p == Path::Int8x2 ? corr * 256 + x.x8_lo_corr[size_t(r * nb + b)] : corr;
    }
  a.x8_bm = {scale_bm.data(), sum_bm.data(), corr_bm.data(), x.M};
  // the pair tiles' x16 (int8.h), as quant_linear.cpp makes it
  std::vector<int16_t> c16;
  if (p == Path::Int8x2 && k.pair_tiles && x.M >= pair_min_rows(w.qtype)) {
    c16.resize(size_t(x.M * w.K));
    for (int64_t r = 0; r < x.M; ++r)
      pair_codes(x.x8.data() + r * w.K, x.x8_lo.data() + r * w.K, w.K, c16.data() + r * w.K);
    a.x16 = c16.data();
  }
  if (p == Path::Int8 || p == Path::Int8x2) {
    Int8Panel panel;
    for (int64_t n0 = 0; n0 < w.N; n0 += kI8ChunkRows) k.int8_rows(a, n0, std::min(w.N, n0 + kI8ChunkRows), panel);
  } else {
    std::vector<float> scratch;
    const RowsKernel kernel = p == Path::Int16 ? k.int16_rows : k.fp32_rows;
    for (int64_t n0 = 0; n0 < w.N; n0 += kRowsPerChunk) kernel(a, n0, std::min(w.N, n0 + kRowsPerChunk), scratch);
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The build's quantizer of x against the scalar one on rows with zero and tiny blocks.
void check_quantizer(const LinearBuild& b, const LinearBuild& s, QType t, int64_t K) {
  const int64_t nb = K / kBlock;
  std::vector<float> x(static_cast<size_t>(K));
  for (float& v : x) v = uniform(-3.f, 3.f);
  std::fill(x.begin(), x.begin() + kBlock, 0.f);            // an all-zero block
  for (int k = kBlock; k < 2 * kBlock; ++k) x[size_t(k)] *= 1e-40f;  // subnormal values
  std::vector<int8_t> c1(static_cast<size_t>(K)), c2(c1);
  std::vector<float> d1(static_cast<size_t>(nb)), d2(d1), s1(d1), s2(d1);
  std::vector<int32_t> r1(static_cast<size_t>(nb)), r2(r1);
  b.kernel.x8_quantize(x.data(), K, t, c1.data(), d1.data(), r1.data(), s1.data());
  s.kernel.x8_quantize(x.data(), K, t, c2.data(), d2.data(), r2.data(), s2.data());
  DRIVER_CHECK(c1 == c2 && r1 == r2 && same_bits(d1, d2) && same_bits(s1, s2), "%s: x8_quantize differs", b.name);
}

// The s16 layout (s16.h): a build's s16 kernel on int8 codes and on packed
// codes (its own unpacking, or its direct reads of calls of few rows, as
// s16.cpp drives them) against the scalar definition on int8 codes, for
// int8 and int8x2 x, with and without offsets, 2-6 bit codes.
// With `panels` (a build with a panel layout, packed codes), the weight's
// persistent panels built chunk by chunk, read with the weight's pointers
// nulled as quant_linear.cpp does; unpack_panel_chunk must give the packed
// codes and scales back byte for byte.
// With `blocks`, 5-bit codes packed per 32-block (q8_packed.h) and, with
// `half_pairs`, the scales as fp16 [N, K/32] (the weight's d and m pairs).
std::vector<float> run_s16(const Kernels& k, const Weight& w, const X& x, bool two_terms, int bits, int bias,
                           bool panels = false, bool blocks = false, bool half_pairs = false) {
  const int64_t K = w.K, nh = K / kS16Half, nb = K / kBlock;
  std::vector<float> out;
  LinearArgs a = args(w, x, out);
  a.qtype = QType::S16;
  a.code_bits = bits;
  a.code_bias = bias;
  a.code_blocks = blocks;
  a.x8_lo = two_terms ? x.x8_lo.data() : nullptr;
  std::vector<int8_t> codes(size_t(w.N * K));  // the weight's int8 codes, for the kernel or to pack
  std::memcpy(codes.data(), w.qs.data(), codes.size());
  std::vector<uint8_t> packed;
  if (blocks) {
    packed.assign(size_t(w.N * a.row_bytes()), 0);
    for (int64_t n = 0; n < w.N; ++n) pack_block5_row(codes.data() + n * K, K, bias, packed.data() + n * a.row_bytes());
    a.qs = packed.data();
  } else if (bits != 8) {  // s16.h's layout, written here from its comment
    packed.assign(size_t(w.N * a.row_bytes()), 0);
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const int u = codes[size_t(n * K + k)] + bias, j = int(k % kS16PackedGroup) / kBlock, l = int(k % kBlock);
        uint8_t* group = packed.data() + n * a.row_bytes() + k / kS16PackedGroup * s16_packed_group_bytes(bits);
        const int base = bits >= 4 ? 4 : 2, h = bits - base;  // the low bits' planes, then the high bits'
        group[32 * (j / (8 / base)) + l] |= uint8_t((u & ((1 << base) - 1)) << (base * (j % (8 / base))));
        if (h > 0) group[32 * base + 32 * (j / (8 / h)) + l] |= uint8_t((u >> base) << (h * (j % (8 / h))));
      }
    a.qs = packed.data();
  }
  AlignedVector<uint8_t> cache;
  if (panels) {  // before the half sums: the driver's choices depend on them (s16.h)
    const int64_t chunk = k.panel_chunk_bytes(a, a.panel_scales), chunks = (w.N + kI8ChunkRows - 1) / kI8ChunkRows;
    cache.resize(size_t(chunks * chunk));
    for (int64_t c = 0; c < chunks; ++c)
      k.build_panel_chunk(a, c * kI8ChunkRows, std::min(w.N, (c + 1) * kI8ChunkRows), cache.data() + c * chunk);
    std::vector<uint8_t> qs(packed.size());
    std::vector<float> d(w.d.size()), m(w.m.size());
    LinearArgs back = a;
    back.qs = qs.data();
    back.d = d.data();
    back.m = m.empty() ? nullptr : m.data();
    for (int64_t c = 0; c < chunks; ++c)
      k.unpack_panel_chunk(back, c * kI8ChunkRows, std::min(w.N, (c + 1) * kI8ChunkRows), cache.data() + c * chunk);
    DRIVER_CHECK(qs == packed && same_bits(d, w.d) && same_bits(m, w.m),
                 "s16 panels of %d-bit codes: unpacked, not the weight's arrays", bits);
    a.panels = cache.data();
    a.panel_offsets = a.has_offsets();
    a.qs = nullptr;
    a.d = a.m = nullptr;
  }
  std::vector<uint16_t> d16, m16;  // half pairs: each block's first half's value (its pair's, by construction)
  if (half_pairs) {
    for (int64_t i = 0; i < w.N * nb; ++i) d16.push_back(attn::float_to_f16(w.d[size_t(2 * i)]));
    for (int64_t i = 0; !w.m.empty() && i < w.N * nb; ++i) m16.push_back(attn::float_to_f16(w.m[size_t(2 * i)]));
    a.d = a.m = nullptr;
    a.d16 = d16.data();
    a.m16 = m16.empty() ? nullptr : m16.data();
  }
  std::vector<float> xs(size_t(x.M * nh));  // the half sums (s16.cpp), and bias times them
  std::vector<int32_t> half_bias(size_t(x.M * nh));
  std::vector<int16_t> c16(size_t(x.M * K));
  for (int64_t r = 0; r < x.M; ++r) {
    const int8_t* hi = x.x8.data() + r * K;
    const int8_t* lo = two_terms ? x.x8_lo.data() + r * K : nullptr;
    for (int64_t h = 0; h < nh; ++h) {
      int32_t sum = 0;
      for (int64_t i = h * kS16Half; i < (h + 1) * kS16Half; ++i) sum += lo ? hi[i] * 256 + lo[i] : hi[i];
      xs[size_t(r * nh + h)] = x.x8_scale[size_t(r * nb + h / 2)] * float(sum);
      half_bias[size_t(r * nh + h)] = s16_group_bias(k, a, x.M, two_terms) * sum;
    }
    pair_codes(hi, lo, K, c16.data() + r * K);
  }
  const bool reads_packed = s16_reads_packed(k, a, x.M);
  S16Args sa{&a, w.m.empty() ? nullptr : xs.data(), s16_group_bias(k, a, x.M, two_terms) ? half_bias.data() : nullptr,
             s16_reads_c16(k, a, x.M, two_terms) ? c16.data() : nullptr};
  const S16Kernel kernel = k.s16_rows ? k.s16_rows : isa_scalar::s16_rows;
  const S16Unpack unpack = k.s16_unpack ? k.s16_unpack : unpack_s16_rows;
  const Block5Unpack unpack5 = k.block5_unpack ? k.block5_unpack : unpack_block5_rows;
  // scales: compact forms read by the few-rows kernel, else widened per work item (s16.cpp)
  const bool scales_read = k.s16_few_rows_reads_compact && x.M <= kS16FewRows;
  const ItemWidener widen = item_widener(k);
  std::vector<int8_t> rows(size_t(kI8ChunkRows * K));
  for (int64_t n0 = 0; n0 < w.N; n0 += kI8ChunkRows) {
    const int64_t n1 = std::min(w.N, n0 + kI8ChunkRows);
    LinearArgs item = scales_read || panels ? a : widen.item(a, n0, n1);
    sa.a = &item;
    sa.codes = codes.data();
    sa.codes_row0 = 0;
    if (panels) {
      sa.codes = nullptr;  // the kernel reads the panels
    } else if (bits != 8 && !reads_packed) {
      if (blocks) unpack5(a.qs + n0 * a.row_bytes(), K, bias, n1 - n0, rows.data());
      else unpack(a.qs + n0 * a.row_bytes(), K, bits, bias, n1 - n0, rows.data());
      item.code_bits = 8;  // the kernel reads the unpacked rows as bytes
      item.code_blocks = false;
      sa.codes = rows.data();
      sa.codes_row0 = n0;
    } else if (bits != 8) {
      sa.codes = nullptr;  // the kernel reads the packed codes itself
    }
    kernel(sa, n0, n1);
  }
  return out;
}

void check_s16(const LinearBuild& b, const LinearBuild& s) {
  struct Form {
    int bits, lo, hi;
  };
  const Form forms[] = {{8, -128, 127}, {2, 0, 3}, {3, -4, 3}, {4, -8, 7}, {5, 0, 31}, {6, -32, 31}, {6, 0, 63}};
  for (const Form& f : forms)
    for (bool offsets : {false, true})
      for (int64_t M : {1, 2, 3, 5, 9, 20, 60}) {  // tiles of 4 x rows from 9 (persistent panels: in place to 48)
        // bytes: K a multiple of 32 only (blocks past whole groups of 8)
        Weight w{QType::Q8_0, 37, f.bits == 8 ? 544 : 512, {}, {}, {}};
        for (int64_t i = 0; i < w.N * w.K; ++i) w.qs.push_back(uint8_t(int8_t(uniform_int(f.lo, f.hi))));
        for (int64_t i = 0; i < w.N * w.K / kS16Half; ++i) w.d.push_back(uniform(-0.02f, 0.02f));
        if (offsets)
          for (int64_t i = 0; i < w.N * w.K / kS16Half; ++i) w.m.push_back(uniform(-0.1f, 0.1f));
        const X x = random_x(w, M, isa_scalar::x8_quantize);
        const int bias = f.lo < 0 ? -f.lo : 0;
        for (bool two_terms : {false, true}) {
          const std::vector<float> want = run_s16(s.kernel, w, x, two_terms, 8, 0);
          DRIVER_CHECK(same_bits(run_s16(b.kernel, w, x, two_terms, f.bits, f.bits == 8 ? 0 : bias), want),
                       "%s s16, %d-bit codes, M=%lld, %s, %s: not bitwise equal to scalar", b.name, f.bits,
                       (long long)M, two_terms ? "int8x2" : "int8", offsets ? "offsets" : "no offsets");
          if (b.kernel.panel_chunk_bytes && f.bits != 8)
            DRIVER_CHECK(same_bits(run_s16(b.kernel, w, x, two_terms, f.bits, bias, true), want),
                         "%s s16 panels, %d-bit codes, M=%lld, %s, %s: not bitwise equal to scalar", b.name, f.bits,
                         (long long)M, two_terms ? "int8x2" : "int8", offsets ? "offsets" : "no offsets");
        }
      }
}

// Codes packed per 32-block (q8_packed.h) against the scalar build on bytes:
// q8_0's 5-bit codes and IQ4_NL table indices through int8_rows (read in
// place where the build says q8_reads_packed / q8_reads_table, else unpacked
// per work item by its block5_unpack / table4_unpack, as quant_linear.cpp
// does; the avx512 panels of them too, and their unpacking back to the
// packed rows), and s16's ("s16.u5b") with float32 and fp16 half-pair
// scales through s16_rows; K not a multiple of 256 (odd block counts: the
// AVX2 table unpacker's two-block vectors and its tail).
void check_packed_blocks(const LinearBuild& b, const LinearBuild& s) {
  const Block5Unpack unpack5 = b.kernel.block5_unpack ? b.kernel.block5_unpack : unpack_block5_rows;
  const Table4Unpack unpack4 = b.kernel.table4_unpack ? b.kernel.table4_unpack : unpack_table4_rows;
  for (bool table : {false, true})
    for (int64_t K : {32, 288, 896}) {
      const char* form = table ? "q8_0.nl4" : "q8_0.s5";
      const int64_t block_bytes = table ? kBlock / 2 : kQ8PackedBlockBytes;
      Weight w = random_weight(QType::Q8_0, 70, K);
      for (uint8_t& c : w.qs) c = uint8_t(table ? kIq4nlValues[uniform_int(0, 15)] : int8_t(uniform_int(-16, 15)));
      std::vector<uint8_t> packed(size_t(w.N * K / kBlock * block_bytes));
      for (int64_t n = 0; n < w.N; ++n) {
        const int8_t* row = reinterpret_cast<const int8_t*>(w.qs.data()) + n * K;
        if (!table) pack_block5_row(row, K, kQ8PackedBias, packed.data() + n * K / kBlock * block_bytes);
        else DRIVER_CHECK(pack_table4_row(row, K, packed.data() + n * K / 2), "pack_table4_row refused a table value");
      }
      std::vector<int8_t> back(w.qs.size());
      if (table) unpack4(packed.data(), K, w.N, back.data());
      else unpack5(packed.data(), K, kQ8PackedBias, w.N, back.data());
      DRIVER_CHECK(std::memcmp(back.data(), w.qs.data(), back.size()) == 0, "%s %s unpacking, K=%lld: other bytes",
                   b.name, form, (long long)K);
      const bool reads = table ? b.kernel.q8_reads_table : b.kernel.q8_reads_packed;
      for (int64_t M : {1, 3, 8, 9, 17, 40})
        for (Path p : {Path::Int8, Path::Int8x2}) {
          const X x = random_x(w, M, isa_scalar::x8_quantize);
          const std::vector<float> want = run(s.kernel, p, w, x);
          std::vector<float> got;
          LinearArgs a = args(w, x, got);
          a.code_bits = table ? kQ8TableBits : kQ8PackedBits;
          a.code_bias = table ? 0 : kQ8PackedBias;
          a.qs = packed.data();
          if (p == Path::Int8x2) {
            a.x8_lo = x.x8_lo.data();
            a.x8_lo_corr = x.x8_lo_corr.data();
          }
          std::vector<int16_t> c16;  // the pair tiles' x16, as quant_linear.cpp makes it
          if (p == Path::Int8x2 && b.kernel.pair_tiles && M >= pair_min_rows(QType::Q8_0)) {
            c16.resize(size_t(M * K));
            for (int64_t r = 0; r < M; ++r)
              pair_codes(x.x8.data() + r * K, x.x8_lo.data() + r * K, K, c16.data() + r * K);
            a.x16 = c16.data();
          }
          const ItemCodes unpack = item_codes(b.kernel);
          Int8Panel panel;
          for (int64_t n0 = 0; n0 < w.N; n0 += kI8ChunkRows) {
            const int64_t n1 = std::min(w.N, n0 + kI8ChunkRows);
            b.kernel.int8_rows(reads ? a : unpack.item(a, n0, n1), n0, n1, panel);
          }
          DRIVER_CHECK(same_bits(got, want), "%s %s, K=%lld M=%lld %s: not bitwise the scalar build's bytes", b.name,
                       form, (long long)K, (long long)M, path_name(p));
          if (!b.kernel.panel_chunk_bytes || !reads) continue;
          a.panel_scales = PanelScales::F32;
          const int64_t chunk = b.kernel.panel_chunk_bytes(a, a.panel_scales);
          const int64_t chunks = (w.N + kI8ChunkRows - 1) / kI8ChunkRows;
          AlignedVector<uint8_t> panels(size_t(chunks * chunk));
          for (int64_t c = 0; c < chunks; ++c)
            b.kernel.build_panel_chunk(a, c * kI8ChunkRows, std::min(w.N, (c + 1) * kI8ChunkRows),
                                       panels.data() + c * chunk);
          std::vector<uint8_t> qs(packed.size());
          std::vector<float> d(w.d.size());
          LinearArgs unpacked = a;
          unpacked.qs = qs.data();
          unpacked.d = d.data();
          for (int64_t c = 0; c < chunks; ++c)
            b.kernel.unpack_panel_chunk(unpacked, c * kI8ChunkRows, std::min(w.N, (c + 1) * kI8ChunkRows),
                                        panels.data() + c * chunk);
          DRIVER_CHECK(qs == packed && same_bits(d, w.d), "%s %s panels, K=%lld: unpacked, not the weight's arrays",
                       b.name, form, (long long)K);
          LinearArgs cached = a;
          std::fill(got.begin(), got.end(), NAN);
          cached.panels = panels.data();
          cached.qs = nullptr;
          cached.d = nullptr;
          for (int64_t n0 = 0; n0 < w.N; n0 += kI8ChunkRows)
            b.kernel.int8_rows(cached, n0, std::min(w.N, n0 + kI8ChunkRows), panel);
          DRIVER_CHECK(same_bits(got, want), "%s %s panels, K=%lld M=%lld %s: not bitwise the scalar build's bytes",
                       b.name, form, (long long)K, (long long)M, path_name(p));
        }
    }
  for (bool offsets : {false, true})
    for (int64_t M : {1, 3, 8, 9, 20}) {
      Weight w{QType::Q8_0, 37, 288, {}, {}, {}};  // s16 codes 0..31, K not a multiple of 256
      for (int64_t i = 0; i < w.N * w.K; ++i) w.qs.push_back(uint8_t(int8_t(uniform_int(0, 31))));
      const auto pair_of = [](float v) { return attn::f16_to_float(attn::float_to_f16(v)); };
      for (int64_t i = 0; i < w.N * w.K / kBlock; ++i) {  // each block's halves on one fp16 value
        const float d = pair_of(uniform(-0.02f, 0.02f)), m = pair_of(uniform(-0.1f, 0.1f));
        w.d.insert(w.d.end(), {d, d});
        if (offsets) w.m.insert(w.m.end(), {m, m});
      }
      const X x = random_x(w, M, isa_scalar::x8_quantize);
      for (bool two_terms : {false, true}) {
        const std::vector<float> want = run_s16(s.kernel, w, x, two_terms, 8, 0);
        for (bool half_pairs : {false, true})
          DRIVER_CHECK(same_bits(run_s16(b.kernel, w, x, two_terms, 5, 0, false, true, half_pairs), want),
                       "%s s16.u5b, M=%lld, %s, %s, %s scales: not bitwise equal to scalar", b.name, (long long)M,
                       two_terms ? "int8x2" : "int8", offsets ? "offsets" : "no offsets",
                       half_pairs ? "half-pair" : "float32");
      }
    }
}

#if defined(PAGED_ISA_X86)
// The avx512 build where this CPU runs it (the panels' layout), else null
// with a line saying what `what` leaves unchecked.
const LinearBuild* avx512_build(const char* what) {
  static const std::vector<LinearBuild> builds = linear_builds();
  const auto b = std::find_if(builds.begin(), builds.end(),
                              [](const LinearBuild& l) { return std::string(l.name) == "avx512"; });
  if (b != builds.end() && b->supported()) return &*b;
  std::printf("linear avx512: %s not checked (no AVX512-VNNI)\n", what);
  return nullptr;
}

// The weight in a's persistent panels (its a.panel_scales form), built chunk by chunk by k.
AlignedVector<uint8_t> persistent_panels(const Kernels& k, const LinearArgs& a) {
  const int64_t chunk = k.panel_chunk_bytes(a, a.panel_scales);
  const int64_t chunks = (a.N + kI8ChunkRows - 1) / kI8ChunkRows;
  AlignedVector<uint8_t> panels(size_t(chunks * chunk));
  for (int64_t c = 0; c < chunks; ++c)
    k.build_panel_chunk(a, c * kI8ChunkRows, std::min(a.N, (c + 1) * kI8ChunkRows), panels.data() + c * chunk);
  return panels;
}

// The AMX builds read a persistent 4-bit panel's codes widened from its
// nibbles (chunk_panel): they must be the byte panel built per call for the
// same chunk, byte for byte, and the scales the same floats. (The VNNI
// build's reads of the nibbles in place are checked through quant_linear by
// tests/test_weight_panels.py; AMX itself runs only where the CPU has it.)
void check_widened_panels() {
  const LinearBuild* avx512 = avx512_build("widened panels");
  if (!avx512) return;
  for (QType t : {QType::Q4_0, QType::Q4_1})
    for (int64_t K : {96, 576}) {
      const Weight w = random_weight(t, 72, K);
      const X x = random_x(w, 1, isa_scalar::x8_quantize);
      std::vector<float> out;
      LinearArgs a = args(w, x, out);
      const int64_t nb = K / kBlock;
      const AlignedVector<uint8_t> persistent = persistent_panels(avx512->kernel, a);  // float32 scales
      LinearArgs cached = a;
      cached.panels = persistent.data();
      for (int64_t n0 = 0; n0 < w.N; n0 += kI8ChunkRows) {
        const int64_t n1 = std::min(w.N, n0 + kI8ChunkRows);
        Int8Panel s1, s2;
        const isa_avx512::PanelView wide = isa_avx512::chunk_panel(cached, n0, n1, false, s1);
        const isa_avx512::PanelView built = isa_avx512::chunk_panel(a, n0, n1, false, s2);
        const size_t scale_bytes = size_t(nb * isa_avx512::kPanel) * sizeof(float);
        DRIVER_CHECK(std::memcmp(wide.codes, built.codes, size_t(nb * isa_avx512::kBlockBytes)) == 0 &&
                         std::memcmp(wide.d, built.d, scale_bytes) == 0 &&
                         (t != QType::Q4_1 || std::memcmp(wide.m, built.m, scale_bytes) == 0),
                     "widened panel of qtype %d, K=%lld, rows %lld..%lld differs from the built one", int(t),
                     (long long)K, (long long)n0, (long long)n1);
      }
    }
}

// Persistent panels in every scale form (PanelScales: float32, fp16 and
// q4_1's and q8_0's compact bytes and supers, float32 or fp16): the avx512 int8 kernel reading them,
// with the weight's own pointers nulled as quant_linear.cpp does, is bitwise
// the kernel building its panels per call, and unpack_panel_chunk gives the
// weight's arrays back byte for byte. (Under the sanitizer build too: the
// forms' build, reads and unpacking touch only their own bytes.)
void check_panel_forms() {
  const LinearBuild* avx512 = avx512_build("panel scale forms");
  if (!avx512) return;
  const Kernels& k = avx512->kernel;
  const auto fp16 = [](float v) { return attn::f16_to_float(attn::float_to_f16(v)); };
  constexpr int64_t N = 72, K = 512, nb = K / kBlock, chunks = (N + kI8ChunkRows - 1) / kI8ChunkRows;
  for (QType t : {QType::Q4_0, QType::Q4_1, QType::Q8_0})
    for (PanelScales form : {PanelScales::F32, PanelScales::F16, PanelScales::Compact, PanelScales::CompactF16}) {
      const bool compact = compact_form(form);
      if (compact && t == QType::Q4_0) continue;  // Q4_K's q4_1 and IQ4_XS's q8_0 have them
      Weight w = random_weight(t, N, K);
      std::vector<uint8_t> d8, m8;  // compact rows: a byte per block, then a float32 per 256 weights
      const bool offsets = t == QType::Q4_1;
      if (form == PanelScales::F16)
        for (auto* v : {&w.d, &w.m}) std::transform(v->begin(), v->end(), v->begin(), fp16);
      if (compact)
        for (auto* c : {&d8, &m8}) {
          if (c == &m8 && !offsets) break;
          c->resize(size_t(N * compact_row_bytes(nb, K)));
          for (int64_t n = 0; n < N; ++n) {
            uint8_t* row = c->data() + n * compact_row_bytes(nb, K);
            for (int64_t b = 0; b < nb; ++b) row[b] = uint8_t(uniform_int(-63, 63));
            for (int64_t g = 0; g < K / kCompactWeights; ++g) {
              const float super = fp16(uniform(-0.01f, 0.01f));
              std::memcpy(row + nb + 4 * g, &super, 4);
            }
          }
        }
      for (int64_t M : {1, 9}) {
        const X x = random_x(w, M, isa_scalar::x8_quantize);
        std::vector<float> want, got;
        LinearArgs a = args(w, x, want);
        a.x8_lo = x.x8_lo.data();
        a.x8_lo_corr = x.x8_lo_corr.data();
        if (compact) {
          a.d = a.m = nullptr;
          a.d8 = d8.data();
          a.m8 = offsets ? m8.data() : nullptr;
        }
        a.panel_scales = form;
        const AlignedVector<uint8_t> panels = persistent_panels(k, a);
        const int64_t chunk = k.panel_chunk_bytes(a, form);
        LinearArgs cached = a;
        got.assign(want.size(), NAN);
        cached.out = got.data();
        cached.panels = panels.data();
        cached.qs = nullptr;
        cached.d = cached.m = nullptr;
        cached.d8 = cached.m8 = nullptr;
        Int8Panel scratch;
        for (int64_t n0 = 0; n0 < N; n0 += kI8ChunkRows) {
          k.int8_rows(a, n0, std::min(N, n0 + kI8ChunkRows), scratch);
          k.int8_rows(cached, n0, std::min(N, n0 + kI8ChunkRows), scratch);
        }
        DRIVER_CHECK(same_bits(got, want), "panels of qtype %d, scale form %d, M=%lld: not the per-call panels' bits",
                     int(t), int(form), (long long)M);
        // unpacked into fresh arrays: the weight's own bytes
        std::vector<uint8_t> qs(w.qs.size()), ud8(d8.size()), um8(m8.size());
        std::vector<float> ud(w.d.size()), um(w.m.size());
        LinearArgs back = a;
        back.qs = qs.data();
        back.d = compact ? nullptr : ud.data();
        back.m = compact || um.empty() ? nullptr : um.data();
        back.d8 = compact ? ud8.data() : nullptr;
        back.m8 = compact && offsets ? um8.data() : nullptr;
        for (int64_t c = 0; c < chunks; ++c)
          k.unpack_panel_chunk(back, c * kI8ChunkRows, std::min(N, (c + 1) * kI8ChunkRows), panels.data() + c * chunk);
        const bool same = qs == w.qs && (compact ? ud8 == d8 && um8 == m8
                                                                       : same_bits(ud, w.d) && same_bits(um, w.m));
        DRIVER_CHECK(same, "unpacked panels of qtype %d, scale form %d differ from the weight", int(t), int(form));
      }
    }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const auto expected = expected_builds(argc, argv);
  check_features(expected);
  const Int8Quantize quantize = isa_scalar::x8_quantize;
  struct Shape {
    int64_t N, K;
  };
  const Shape shapes[] = {{72, 256}, {37, 96}, {130, 512}};
  check_family("linear", linear_builds(), expected, [&](const LinearBuild& b, const LinearBuild& s) {
    for (QType t : {QType::Q4_0, QType::Q4_1, QType::Q8_0}) {
      for (const Shape& sh : shapes) {
        const Weight w = random_weight(t, sh.N, sh.K);
        check_quantizer(b, s, t, sh.K);
        for (int64_t M : {1, 2, 3, 5, 9, 16, 17, 40}) {  // amx: tiles from 8 rows, groups of 16
          const X x = random_x(w, M, quantize);
          for (Path p : {Path::Int16, Path::Fp32, Path::Int8, Path::Int8x2}) {
            if (p == Path::Int16 && M > kInt16MaxRows) continue;
            const std::vector<float> got = run(b.kernel, p, w, x), want = run(s.kernel, p, w, x);
            DRIVER_CHECK(same_bits(got, want), "%s %s path, qtype %d, N=%lld K=%lld M=%lld: not bitwise equal",
                         b.name, path_name(p), int(t), (long long)sh.N, (long long)sh.K, (long long)M);
          }
        }
      }
    }
    check_s16(b, s);
    check_packed_blocks(b, s);
  });
#if defined(PAGED_ISA_X86)
  check_widened_panels();
  check_panel_forms();
#endif
  return finish("kernel_linear_driver");
}
