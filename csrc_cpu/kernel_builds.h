// The one table of the CPU kernels' SIMD builds (csrc_cpu/README.md): for
// every kernel family its builds best first, each with the ISA level it
// belongs to and the CPU-feature predicate that allows it, and the ISA
// levels themselves. Read by the families' boundaries (attention/dispatch.cpp,
// attention/attention_ops.cpp, attention/cache_ops.cpp, linear/quant_linear.cpp,
// linear/bf16_prompt.cpp, linear/weight_panels.cpp, ops/fused_ops.cpp), by
// the C++ drivers that run every build against the scalar one
// (tests/kernel_attention_driver.cpp, tests/kernel_linear_driver.cpp), and by
// Python through _C_cpu.kernel_builds() / kernel_levels()
// (backends/cpu/host/isa.py). Free of nanobind, so the drivers link it
// without Python.
#pragma once

#include <string>
#include <vector>

#include "attention/kernel_common.h"
#include "isa_select.h"
#include "linear/bf16_prompt.h"
#include "linear/quant_linear.h"
#include "ops/row_kernels.h"

namespace paged::cpu {

// ISA levels: CPU generations, best first, each capping every family at once
// (x86-64: avx512, avx2, scalar; aarch64: i8mm, dotprod, neon, scalar; any
// other CPU: scalar). A build belongs to the level whose CPUs may run it.
struct Level {
  const char* name;
  const char* hides;    // PAGED_CPU_HIDE that runs a process at this level
  bool (*supported)();  // this CPU, as PAGED_CPU_HIDE leaves it, is of this level or newer
};
const std::vector<Level>& levels();

using AttentionKernel = void (*)(const attn::AttnArgs&);
using AttentionBuild = Build<AttentionKernel>;
using LinearBuild = Build<linear::Kernels>;
using FusedOpsBuild = Build<const ops::RowKernels*>;
using F16RowBuild = Build<attn::F16RowKernel>;
using Bf16RowsBuild = Build<linear::Bf16Kernels>;

// Families chosen by name (IsaSelector: auto, a build, PAGED_CPU_ISA);
// the last build, scalar, runs everywhere.
std::vector<AttentionBuild> attention_builds();
std::vector<LinearBuild> linear_builds();
std::vector<FusedOpsBuild> fused_ops_builds();
IsaSelector<AttentionKernel>& attention_selector();
IsaSelector<linear::Kernels>& linear_selector();
IsaSelector<const ops::RowKernels*>& fused_ops_selector();

// Families that run the first build this CPU allows: a float16 cache row's
// write (scalar last), and the prompt-row kernels, which have no scalar
// build (their callers fall back to the float32 paths) and may be empty.
std::vector<F16RowBuild> f16_cache_row_builds();
std::vector<AttentionBuild> lanes_prompt_attention_builds();  // only where attention runs that level
std::vector<AttentionBuild> bf16_prompt_attention_builds();
std::vector<Bf16RowsBuild> bf16_prompt_rows_builds();

// What those families run now: a kernel, or null where none runs.
attn::F16RowKernel f16_cache_row();
AttentionKernel lanes_prompt_attention();
AttentionKernel bf16_prompt_attention();
const linear::Bf16Kernels* bf16_prompt_rows();

// The whole table as data, families in a fixed order (Python's kernel_builds()).
struct BuildState {
  std::string name, level;
  bool supported, active;
};
struct FamilyState {
  std::string family;
  bool selectable;  // set_kernel_build / PAGED_CPU_ISA choose its build
  std::vector<BuildState> builds;
};
std::vector<FamilyState> kernel_families();
// A selectable family's build by name ("auto" or one this CPU runs).
void set_kernel_build(const std::string& family, const std::string& name);

}  // namespace paged::cpu
