// Every attention build of this architecture (kernel_builds.h) against the
// scalar build on random paged caches: decode and prefill rows, GQA, sliding
// windows, sequences long enough to split, float32 / bfloat16 / float16, and
// caches of another dtype than the query's (int8 and fp8_e4m3 rows, bf16).
// The builds' vector widths differ, so their sums run in different orders:
// outputs must agree within a stated tolerance (float32: 1e-6 absolute on
// values of magnitude <= 1, 8 ulp at 1, where the exp polynomials differ by
// ~1 ulp (measured: 1.5e-7 for avx2, avx512 and neon); bf16 / f16 outputs:
// one unit in the last place of the result format at 1, 2^-8 / 2^-10, since
// a tiny fp32 difference can round either way).
// Built natively by tests/test_kernel_drivers.py, cross-built and run under
// qemu-aarch64 by .ci/arm_emulation.sh.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "attention/prompt_bf16.h"
#include "attention/prompt_lanes.h"
#include "kernel_builds.h"
#include "tests/driver_util.h"

namespace {

using namespace paged::cpu;
using namespace paged::cpu::test;
using attn::AttnArgs;
using attn::DType;

struct Case {
  DType dtype;  // query and output
  int64_t heads, kv_heads, head_size, block_size;
  std::vector<std::pair<int, int>> seqs;  // (context length, query rows)
  int64_t window;
  DType cache;  // the KV cache's dtype (I8, FP8: quantized rows)
};

const char* dtype_name(DType t) {
  return t == DType::F32 ? "f32" : t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : t == DType::I8 ? "i8" : "fp8";
}

// Random values in [-1, 1] stored in the case's dtype.
std::vector<uint16_t> random_store(int64_t n, DType t) {
  std::vector<uint16_t> out(size_t(n) * (t == DType::F32 ? 2 : 1));
  for (int64_t i = 0; i < n; ++i) attn::store_scalar(out.data(), i, t, uniform(-1.f, 1.f));
  return out;
}

// `rows` cache rows of head size D with random values in [-1, 1] in dtype t
// (I8, FP8: each row quantized as reshape_and_cache does, codes then scale).
std::vector<uint16_t> random_cache(int64_t rows, int64_t D, DType t) {
  if (!attn::scaled_rows(t)) return random_store(rows * D, t);
  const int64_t row_bytes = attn::cache_row_bytes(t, D);
  std::vector<uint16_t> out(size_t(rows * row_bytes + 1) / 2);
  std::vector<float> x(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : x) v = uniform(-1.f, 1.f);
    auto* row = reinterpret_cast<uint8_t*>(out.data()) + r * row_bytes;
    if (t == DType::I8) attn::quantize_row_i8(x.data(), D, reinterpret_cast<int8_t*>(row));
    else attn::quantize_row_fp8(x.data(), D, row);
  }
  return out;
}

// Output of one build (as float32), given the case's inputs.
struct Inputs {
  std::vector<uint16_t> q, k, v;
  std::vector<int32_t> tables, lens, starts;
  int64_t tokens = 0, stride = 0;
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  int64_t blocks = 0;
  for (const auto& [len, rows] : c.seqs) {
    in.tokens += rows;
    in.stride = std::max<int64_t>(in.stride, (len + c.block_size - 1) / c.block_size);
  }
  blocks = in.stride * int64_t(c.seqs.size());
  std::vector<int32_t> ids(static_cast<size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng());  // scattered blocks, as a real pool gives
  in.tables = ids;
  in.starts.push_back(0);
  for (const auto& [len, rows] : c.seqs) {
    in.lens.push_back(len);
    in.starts.push_back(in.starts.back() + rows);
  }
  in.q = random_store(in.tokens * c.heads * c.head_size, c.dtype);
  const int64_t rows = blocks * c.kv_heads * c.block_size;
  in.k = random_cache(rows, c.head_size, c.cache);
  in.v = random_cache(rows, c.head_size, c.cache);
  return in;
}

std::vector<float> run(AttentionKernel kernel, const Case& c, const Inputs& in) {
  const int64_t n = in.tokens * c.heads * c.head_size;
  std::vector<uint16_t> out(size_t(n) * 2, 0);
  AttnArgs a{};
  a.out = out.data();
  a.query = in.q.data();
  a.key_cache = in.k.data();
  a.value_cache = in.v.data();
  a.dtype = c.dtype;
  a.cache_dtype = c.cache;
  a.num_heads = c.heads;
  a.num_kv_heads = c.kv_heads;
  a.head_size = c.head_size;
  a.block_size = c.block_size;
  a.block_tables = in.tables.data();
  a.table_stride = in.stride;
  a.seq_lens = in.lens.data();
  a.query_start_loc = in.starts.data();
  a.num_seqs = int64_t(c.seqs.size());
  a.scale = 1.0f / std::sqrt(float(c.head_size));
  a.sliding_window = c.window;
  kernel(a);
  std::vector<float> f(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) f[size_t(i)] = attn::load_scalar(out.data(), i, c.dtype);
  return f;
}

float tolerance(DType t) { return t == DType::F32 ? 1e-6f : (t == DType::BF16 ? 1.f / 256 : 1.f / 1024); }

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    // decode: one row per sequence, lengths across block and split (256) edges
    out.push_back({t, 8, 2, 64, 16, {{1, 1}, {17, 1}, {300, 1}, {777, 1}}, 0, t});
    // prefill and chunked prefill (rows < length: a cached prefix), a window
    out.push_back({t, 4, 4, 128, 16, {{40, 40}, {300, 37}}, 0, t});
    out.push_back({t, 6, 2, 80, 32, {{530, 3}, {64, 64}}, 100, t});
    out.push_back({t, 2, 1, 16, 5, {{99, 9}}, 0, t});
  }
  // a cache dtype other than the query's: int8 / fp8 rows under float32 / bf16, bf16 under float32
  out.push_back({DType::F32, 8, 2, 64, 16, {{1, 1}, {300, 1}, {530, 3}}, 0, DType::I8});
  out.push_back({DType::BF16, 4, 4, 128, 16, {{300, 37}, {40, 40}}, 100, DType::I8});
  out.push_back({DType::F32, 6, 2, 80, 32, {{777, 1}, {64, 64}}, 0, DType::BF16});
  out.push_back({DType::F32, 8, 2, 64, 16, {{1, 1}, {300, 1}, {530, 3}}, 0, DType::FP8});
  out.push_back({DType::BF16, 6, 2, 80, 32, {{300, 37}, {777, 1}}, 100, DType::FP8});
  return out;
}

// A prompt-row build against the scalar build on every case `tol` gives a
// tolerance for (negative: a case it does not take).
template <class Tol>
void check_prompt_build(const char* family, const AttentionBuild& b, const std::vector<Case>& all,
                        const std::vector<Inputs>& inputs, Tol tol) {
  const AttentionKernel scalar = attention_builds().back().kernel;
  float worst = 0.f;
  int ran = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const Case& c = all[i];
    const float t = tol(c);
    if (t < 0.f) continue;
    const std::vector<float> got = run(b.kernel, c, inputs[i]), want = run(scalar, c, inputs[i]);
    float w = 0.f;
    for (size_t j = 0; j < got.size(); ++j) {
      DRIVER_CHECK(std::isfinite(got[j]), "%s %s case %zu: output %zu not finite", family, b.name, i, j);
      w = std::max(w, std::fabs(got[j] - want[j]));
    }
    DRIVER_CHECK(w <= t, "%s %s case %zu (%s, %s cache): max |diff| vs scalar %g > %g", family, b.name, i,
                 dtype_name(c.dtype), dtype_name(c.cache), double(w), double(t));
    worst = std::max(worst, w);
    ++ran;
  }
  DRIVER_CHECK(ran > 0, "%s %s: no case ran", family, b.name);
  std::printf("%s %s: %d cases, max |diff| vs scalar %g\n", family, b.name, ran, double(worst));
}

// Every build of a prompt-row family (kernel_builds.h) this CPU runs.
template <class Tol>
void check_prompt_family(const char* family, const std::vector<AttentionBuild>& builds, const std::vector<Case>& all,
                         const std::vector<Inputs>& inputs, Tol tol) {
  if (builds.empty()) std::printf("%s: no build for this architecture\n", family);
  for (const AttentionBuild& b : builds) {
    if (b.supported())
      check_prompt_build(family, b, all, inputs, tol);
    else
      std::printf("%s %s: not run (not supported here)\n", family, b.name);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto expected = expected_builds(argc, argv);
  check_features(expected);
  const std::vector<Case> all = cases();
  std::vector<Inputs> inputs;
  for (const Case& c : all) inputs.push_back(make_inputs(c));
  check_family("attention", attention_builds(), expected, [&](const AttentionBuild& b, const AttentionBuild& s) {
    float worst_of[3] = {};  // per dtype
    for (size_t i = 0; i < all.size(); ++i) {
      const Case& c = all[i];
      const std::vector<float> got = run(b.kernel, c, inputs[i]), want = run(s.kernel, c, inputs[i]);
      float worst = 0.f;
      for (size_t j = 0; j < got.size(); ++j) worst = std::max(worst, std::fabs(got[j] - want[j]));
      worst_of[int(c.dtype)] = std::max(worst_of[int(c.dtype)], worst);
      const bool finite = std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); });
      DRIVER_CHECK(finite && worst <= tolerance(c.dtype), "%s case %zu (%s, %s cache, D=%lld): max |diff| %g > %g",
                   b.name, i, dtype_name(c.dtype), dtype_name(c.cache), (long long)c.head_size, double(worst),
                   double(tolerance(c.dtype)));
    }
    std::printf("attention %s: max |diff| vs scalar f32 %g, bf16 %g, f16 %g\n", b.name, double(worst_of[0]),
                double(worst_of[1]), double(worst_of[2]));
  });
  // mixed-bf16's prompt attention (AMX-BF16 CPUs): every case it takes
  // (float caches, head sizes a multiple of 32) against the scalar build,
  // within what rounding q, k, v and the probabilities to bfloat16 moves an
  // output of values in [-1, 1] (tests/test_bf16_attention.py checks it
  // against its own definition); here mostly a run under the sanitizers.
  check_prompt_family("bf16_prompt_attention", bf16_prompt_attention_builds(), all, inputs, [](const Case& c) {
    return attn::isa_amx_bf16::reads_cache(c.cache) && attn::isa_amx_bf16::takes_head_size(c.head_size) ? 1.f / 32
                                                                                                        : -1.f;
  });
  // mixed's lane-major float32 prompt attention (AVX-512): every case with
  // a float cache, within the builds' own tolerance (another summation order).
  check_prompt_family("lanes_prompt_attention", lanes_prompt_attention_builds(), all, inputs, [](const Case& c) {
    return attn::isa_avx512_lanes::reads_cache(c.cache) ? tolerance(c.dtype) : -1.f;
  });
  return finish("kernel_attention_driver");
}
