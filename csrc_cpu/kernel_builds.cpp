// The table of kernel_builds.h. A build listed here is compiled for its
// architecture only: CMake compiles arch/x86/ on x86-64 (arch/x86/amx/ where
// the compiler knows AMX, defining PAGED_HAVE_AMX) and arch/arm/ on aarch64,
// the split the PAGED_ISA_X86 / PAGED_ISA_ARM64 sections below follow.
#include "kernel_builds.h"

#include "attention/prompt_bf16.h"
#include "attention/prompt_lanes.h"
#include "linear/int8.h"
#include "linear/half.h"
#include "linear/q8_packed.h"
#include "linear/s16.h"
#include "runtime/runtime.h"

#include <atomic>
#include <cstdlib>
#include <string>

#if defined(PAGED_ISA_X86)
#include "arch/x86/linear/int8_avx512.h"
#endif
#if defined(PAGED_HAVE_AMX) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace paged::cpu {
namespace {

// What each build needs, asked of the one detector (runtime/cpu_features.cpp),
// so PAGED_CPU_HIDE moves every family to the same older generation.
using runtime::cpu_has;

bool always() { return true; }

#if defined(PAGED_ISA_X86)
bool has_avx2() { return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c"); }
bool has_avx512() {
  return has_avx2() && cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") && cpu_has("avx512dq");
}
bool has_avx512vnni() { return has_avx512() && cpu_has("avx512vnni"); }
bool has_avxvnni() { return has_avx2() && cpu_has("avxvnni"); }
#endif

#if defined(PAGED_HAVE_AMX)
// Linux hands out the tile state only on request (kernel 5.16+):
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process (the grant
// covers every thread). Asked only where the CPU has the tiles.
bool tile_state_granted() {
#if defined(__linux__)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}
bool has_amx_int8() { return has_avx512vnni() && cpu_has("amx_int8") && tile_state_granted(); }
bool has_amx_bf16() { return has_avx512() && cpu_has("avx512bf16") && cpu_has("amx_bf16") && tile_state_granted(); }
// The bfloat16 prompt rows read the avx512 build's int8 panels: its VNNI too.
bool has_amx_bf16_rows() { return has_avx512vnni() && has_amx_bf16(); }

// A chunk of bfloat16 prompt rows from the panel the avx512 build's int8
// rows just swept (in cache), so they add no weight stream.
void bf16_panel_rows(const linear::Bf16Args& bf, const linear::LinearArgs& w, int64_t n0, int64_t n1,
                     linear::Int8Panel& panel) {
  linear::isa_amx_bf16::panel_rows(bf, linear::isa_avx512::chunk_panel(w, n0, n1, false, panel), w.qtype, n0, n1);
}
#endif

#if defined(PAGED_ISA_ARM64)
// Advanced SIMD (with fp16 conversions) is in every ARMv8-A core; dotprod
// (sdot/udot) from ARMv8.2 (Cortex-A55/A75, Neoverse N1, Apple M1); i8mm
// (smmla) from ARMv8.6 (Neoverse V1/N2, Graviton 3, Apple M2).
bool has_neon() { return cpu_has("asimd"); }
bool has_dotprod() { return has_neon() && cpu_has("dotprod"); }
bool has_i8mm() { return has_dotprod() && cpu_has("i8mm"); }
#endif

// Position of a level in levels(), best first (past the end: unknown).
size_t level_rank(const char* name) {
  const std::vector<Level>& all = levels();
  for (size_t i = 0; i < all.size(); ++i)
    if (std::string(all[i].name) == name) return i;
  return all.size();
}

// The first build this CPU runs, at or below level `cap` when one is given.
template <class K>
const Build<K>* first_supported(const std::vector<Build<K>>& builds, const char* cap = nullptr) {
  for (const Build<K>& b : builds)
    if (b.supported() && (cap == nullptr || level_rank(b.level) >= level_rank(cap))) return &b;
  return nullptr;
}

const std::vector<F16RowBuild>& f16_cache_row_table() {
  static const std::vector<F16RowBuild> t = f16_cache_row_builds();
  return t;
}
const std::vector<AttentionBuild>& lanes_table() {
  static const std::vector<AttentionBuild> t = lanes_prompt_attention_builds();
  return t;
}
const std::vector<AttentionBuild>& bf16_attention_table() {
  static const std::vector<AttentionBuild> t = bf16_prompt_attention_builds();
  return t;
}
const std::vector<Bf16RowsBuild>& bf16_rows_table() {
  static const std::vector<Bf16RowsBuild> t = bf16_prompt_rows_builds();
  return t;
}

// The lane-major prompt attention runs where attention runs a build of its
// level: a forced lower attention build keeps the float32 prompt kernel.
const AttentionBuild* active_lanes() { return first_supported(lanes_table(), attention_selector().active().level); }

template <class K>
FamilyState state_of(const char* family, bool selectable, const std::vector<Build<K>>& builds,
                     const Build<K>* active) {
  FamilyState f{family, selectable, {}};
  for (const Build<K>& b : builds) f.builds.push_back({b.name, b.level, b.supported(), &b == active});
  return f;
}

}  // namespace

const std::vector<Level>& levels() {
  static const std::vector<Level> table = {
#if defined(PAGED_ISA_X86)
      {"avx512", "", has_avx512},
      {"avx2", "avx512,avxvnni", has_avx2},
      {"scalar", "avx2", always},
#elif defined(PAGED_ISA_ARM64)
      {"i8mm", "", has_i8mm},
      {"dotprod", "i8mm", has_dotprod},
      {"neon", "dotprod,i8mm,sve", has_neon},
      {"scalar", "neon", always},
#else
      {"scalar", "", always},
#endif
  };
  return table;
}

std::vector<AttentionBuild> attention_builds() {
  return {
#if defined(PAGED_ISA_X86)
      // avx2 first, so auto (and every level) picks it on AVX-512 CPUs too:
      // the avx512 build (its decode kernel and the lanes prompt kernel it
      // enables) fails the accuracy gate's floors that the same linear bits
      // with avx2 attention pass, and the lanes kernel breaks chunked-prefill
      // invariance (docs/results.md). Opt in by name: set_kernel_build.
      {"avx2", "avx2", attn::isa_avx2::attention, has_avx2},
      {"avx512", "avx512", attn::isa_avx512::attention, has_avx512},
#elif defined(PAGED_ISA_ARM64)
      {"neon", "neon", attn::isa_neon::attention, has_neon},
#endif
      {"scalar", "scalar", attn::isa_scalar::attention, always}};
}

// A name selects every kernel of that build. The VNNI builds differ only in
// the int8 path and reuse the AVX2 float32 kernels (same bits); amx is
// avx512 with the block sums of calls of >= 8 rows on AMX tiles (same bits
// again); dotprod and i8mm reuse NEON's, and every aarch64 build quantizes x
// with the scalar quantizer. int8x2's low term is the scalar definition
// everywhere but avx512 and amx (its twin there is bitwise the same).
std::vector<LinearBuild> linear_builds() {
  using namespace linear;
#if defined(PAGED_ISA_X86)
  // every x86 build past scalar runs the s16 layout (s16.h), the f16 / bf16
  // layouts (half.h), compact scales' widening (compact_scales.h) and s16's
  // and q8_0's packed codes' unpacking (s16.h, q8_packed.h) on AVX2 (avx512 and amx: s16 on VNNI)
  const auto with_s16 = [](Kernels k) {
    k.s16_rows = isa_avx2::s16_rows;
    k.half_rows = isa_avx2::half_rows;
    k.widen_compact = isa_avx2::widen_compact;
    k.widen_half_pairs = isa_avx2::widen_half_pairs;
    k.s16_unpack = isa_avx2::s16_unpack;
    k.block5_unpack = isa_avx2::block5_unpack;
    k.table4_unpack = isa_avx2::table4_unpack;
    k.q8_reads_packed = true;  // the ymm int8 kernels (avx2, avxvnni) and avx512's read them in place
    k.q8_reads_table = true;
    k.s16_packed_few_rows = true;
    k.s16_few_rows_reads_compact = true;
    return k;
  };
  // avx2's int8x2 pair tiles (int8.h, pair_min_rows)
  const auto with_pair_tiles = [](Kernels k) {
    k.pair_tiles = true;
    return k;
  };
  // avx512's persistent weight panels (weight_panels.h), which amx reads as
  // they lie, and its s16 kernel (VNNI)
  const auto with_panels = [&](Kernels k) {
    k.panel_layout = "avx512";
    k.panel_chunk_bytes = isa_avx512::panel_chunk_bytes;
    k.build_panel_chunk = isa_avx512::build_panel_chunk;
    k.unpack_panel_chunk = isa_avx512::unpack_panel_chunk;
    k = with_s16(k);
    k.s16_rows = isa_avx512::s16_rows;
    k.s16_byte_tiles = true;
    k.int8_reads_compact_scales = true;
    return k;
  };
#endif
  return {
#if defined(PAGED_ISA_X86)
      {"avx512", "avx512",
       with_panels({isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avx512::int8_rows, isa_avx512::x8_quantize,
                    isa_avx512::x8_low_term}),
       has_avx512vnni},
#if defined(PAGED_HAVE_AMX)
      // listed after avx512, so auto never picks it (no faster in the engine:
      // docs/kernels.md, "AMX"); opt in with PAGED_CPU_ISA=amx or
      // set_linear_isa("amx")
      {"amx", "avx512",
       with_panels({isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_amx::int8_rows, isa_avx512::x8_quantize,
                    isa_avx512::x8_low_term, true}),
       has_amx_int8},
#endif
      // AVX-VNNI without AVX-512 (Alder Lake, Zen 5): newer than the avx2
      // level, which hides it, so of the top level
      {"avxvnni", "avx512",
       with_s16({isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avxvnni::int8_rows, isa_avx2::x8_quantize,
                 isa_scalar::x8_low_term}),
       has_avxvnni},
      {"avx2", "avx2",
       with_pair_tiles(with_s16({isa_avx2::int16_rows, isa_avx2::fp32_rows, isa_avx2::int8_rows,
                               isa_avx2::x8_quantize, isa_scalar::x8_low_term})),
       has_avx2},
#elif defined(PAGED_ISA_ARM64)
      {"i8mm", "i8mm",
       {isa_neon::int16_rows, isa_neon::fp32_rows, isa_i8mm::int8_rows, isa_scalar::x8_quantize,
        isa_scalar::x8_low_term},
       has_i8mm},
      {"dotprod", "dotprod",
       {isa_neon::int16_rows, isa_neon::fp32_rows, isa_dotprod::int8_rows, isa_scalar::x8_quantize,
        isa_scalar::x8_low_term},
       has_dotprod},
      {"neon", "neon",
       {isa_neon::int16_rows, isa_neon::fp32_rows, isa_neon::int8_rows, isa_scalar::x8_quantize,
        isa_scalar::x8_low_term},
       has_neon},
#endif
      {"scalar", "scalar",
       {isa_scalar::int16_rows, isa_scalar::fp32_rows, isa_scalar::int8_rows, isa_scalar::x8_quantize,
        isa_scalar::x8_low_term},
       always}};
}

std::vector<FusedOpsBuild> fused_ops_builds() {
  return {
#if defined(PAGED_ISA_X86)
      {"avx2", "avx2", &ops::isa_avx2::kKernels, has_avx2},
#endif
      {"scalar", "scalar", &ops::isa_scalar::kKernels, always}};
}

std::vector<F16RowBuild> f16_cache_row_builds() {
  return {
#if defined(PAGED_ISA_X86)
      {"avx2", "avx2", attn::isa_avx2::f32_to_f16_row, has_avx2},
#endif
      {"scalar", "scalar", attn::isa_scalar::f32_to_f16_row, always}};
}

std::vector<AttentionBuild> lanes_prompt_attention_builds() {
#if defined(PAGED_ISA_X86)
  return {{"avx512", "avx512", attn::isa_avx512_lanes::prompt_attention, has_avx512}};
#else
  return {};
#endif
}

std::vector<AttentionBuild> bf16_prompt_attention_builds() {
#if defined(PAGED_HAVE_AMX)
  return {{"amx", "avx512", attn::isa_amx_bf16::prompt_attention, has_amx_bf16}};
#else
  return {};
#endif
}

std::vector<Bf16RowsBuild> bf16_prompt_rows_builds() {
#if defined(PAGED_HAVE_AMX)
  using namespace linear;
  return {{"amx", "avx512", {isa_amx_bf16::pack_group, isa_amx_bf16::item, bf16_panel_rows}, has_amx_bf16_rows}};
#else
  return {};
#endif
}

IsaSelector<AttentionKernel>& attention_selector() {
  static IsaSelector<AttentionKernel> s(attention_builds(), "attention");
  return s;
}

IsaSelector<linear::Kernels>& linear_selector() {
  static IsaSelector<linear::Kernels> s(linear_builds(), "linear");
  return s;
}

IsaSelector<const ops::RowKernels*>& fused_ops_selector() {
  static IsaSelector<const ops::RowKernels*> s(fused_ops_builds(), "fused ops");
  return s;
}

attn::F16RowKernel f16_cache_row() { return first_supported(f16_cache_row_table())->kernel; }

AttentionKernel lanes_prompt_attention() {
  const AttentionBuild* b = active_lanes();
  return b ? b->kernel : nullptr;
}

AttentionKernel bf16_prompt_attention() {
  const AttentionBuild* b = first_supported(bf16_attention_table());
  return b ? b->kernel : nullptr;
}

const linear::Bf16Kernels* bf16_prompt_rows() {
  const Bf16RowsBuild* b = first_supported(bf16_rows_table());
  return b ? &b->kernel : nullptr;
}

std::vector<FamilyState> kernel_families() {
  return {state_of("attention", true, attention_selector().builds(), &attention_selector().active()),
          state_of("linear", true, linear_selector().builds(), &linear_selector().active()),
          state_of("fused_ops", true, fused_ops_selector().builds(), &fused_ops_selector().active()),
          state_of("f16_cache_row", false, f16_cache_row_table(), first_supported(f16_cache_row_table())),
          state_of("lanes_prompt_attention", false, lanes_table(), active_lanes()),
          state_of("bf16_prompt_attention", false, bf16_attention_table(), first_supported(bf16_attention_table())),
          state_of("bf16_prompt_rows", false, bf16_rows_table(), first_supported(bf16_rows_table()))};
}

void set_kernel_build(const std::string& family, const std::string& name) {
  if (family == "attention") return attention_selector().set(name);
  if (family == "linear") return linear_selector().set(name);
  if (family == "fused_ops") return fused_ops_selector().set(name);
  args::fail("family", "one of attention, linear, fused_ops (the families chosen by name)", "'" + family + "'");
}

// The crossovers between a panel layout's two kernels (s16.h, int8.h): a
// choice between kernels like the builds above, by the core, not the ISA.
namespace linear {
namespace {

struct Crossover {
  const char* env;
  int64_t lo, hi, amd, other;  // valid values; the defaults measured on Zen 4 (AMD) and Ice Lake (Intel)
  std::atomic<int64_t> rows{-1};  // -1: not chosen yet

  int64_t checked(const std::string& name, const std::string& text) const {
    char* end = nullptr;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || (v != 0 && (v < lo || v > hi)))
      args::fail(name, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "] (0: the CPU's default)",
                 "'" + text + "'");
    return v;
  }
  int64_t fallback() const {
    if (const char* e = std::getenv(env))
      if (const int64_t v = checked(env, e)) return v;
    return runtime::cpu_vendor() == "AuthenticAMD" ? amd : other;
  }
  int64_t get() {
    int64_t v = rows.load(std::memory_order_relaxed);
    if (v < 0) rows.store(v = fallback(), std::memory_order_relaxed);
    return v;
  }
  void set(int64_t v) {
    checked("rows", std::to_string(v));
    rows.store(v ? v : fallback(), std::memory_order_relaxed);
  }
};

Crossover s16_crossover{"PAGED_S16_PANEL_ROWS", kS16FewRows, kS16MaxPanelRows, 48, 12};
Crossover nibble_crossover{"PAGED_NIBBLE_PANEL_ROWS", 1, kNibbleMaxPanelRows, 8, 1};

}  // namespace

int64_t s16_panel_rows() { return s16_crossover.get(); }
void set_s16_panel_rows(int64_t rows) { s16_crossover.set(rows); }
int64_t nibble_panel_rows() { return nibble_crossover.get(); }
void set_nibble_panel_rows(int64_t rows) { nibble_crossover.set(rows); }

}  // namespace linear

}  // namespace paged::cpu
