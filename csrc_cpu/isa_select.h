// Run-time choice among the SIMD builds of one CPU kernel family (attention,
// quantized linear, fused layer ops): "auto" = the best build this CPU can
// run, or a build by name; PAGED_CPU_ISA picks the initial one for every
// family that has a build of that name (tests and benchmarks use it). Build
// names are shared by every family: scalar (runs everywhere); on x86-64 avx2,
// avxvnni, avx512, amx; on aarch64 neon, dotprod, i8mm. A family lists only the
// builds compiled for the target architecture (kernel_builds.cpp, with
// PAGED_ISA_X86 / PAGED_ISA_ARM64 below: the same split as
// csrc_cpu/CMakeLists.txt makes on file names).
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "arg_error.h"
#include "runtime/runtime.h"

#if defined(__x86_64__)
#define PAGED_ISA_X86 1
#elif defined(__aarch64__)
#define PAGED_ISA_ARM64 1
#endif

namespace paged::cpu {

// What each build needs, asked of the one detector (runtime/cpu_features.cpp),
// so PAGED_CPU_HIDE moves every family to the same older generation.
inline bool cpu_has_avx2() {
  return runtime::cpu_has("avx2") && runtime::cpu_has("fma") && runtime::cpu_has("f16c");
}

inline bool cpu_has_avx512() {
  return cpu_has_avx2() && runtime::cpu_has("avx512f") && runtime::cpu_has("avx512bw") &&
         runtime::cpu_has("avx512vl") && runtime::cpu_has("avx512dq");
}

inline bool cpu_has_avx512vnni() { return cpu_has_avx512() && runtime::cpu_has("avx512vnni"); }
inline bool cpu_has_amx_int8() { return cpu_has_avx512vnni() && runtime::cpu_has("amx_int8"); }
inline bool cpu_has_avxvnni() { return cpu_has_avx2() && runtime::cpu_has("avxvnni"); }

// aarch64: Advanced SIMD (with fp16 conversions) is in every ARMv8-A core;
// dotprod (sdot/udot) from ARMv8.2 (Cortex-A55/A75, Neoverse N1, Apple M1).
inline bool cpu_has_neon() { return runtime::cpu_has("asimd"); }
inline bool cpu_has_dotprod() { return cpu_has_neon() && runtime::cpu_has("dotprod"); }
// i8mm (smmla) from ARMv8.6 (Neoverse V1/N2, Graviton 3, Apple M2).
inline bool cpu_has_i8mm() { return cpu_has_dotprod() && runtime::cpu_has("i8mm"); }

inline bool cpu_always() { return true; }

template <class Kernel>
class IsaSelector {
 public:
  struct Build {
    const char* name;
    Kernel kernel;
    bool (*supported)();
  };

  // `builds` best first; the last one must run everywhere.
  IsaSelector(std::vector<Build> builds, std::string family) : builds_(std::move(builds)), family_(std::move(family)) {
    const char* env = std::getenv("PAGED_CPU_ISA");
    active_ = &pick("auto");
    if (env && *env)
      for (const Build& b : builds_)
        if (b.name == std::string(env) && b.supported()) active_ = &b;
  }

  const Build& active() const { return *active_; }
  void set(const std::string& name) { active_ = &pick(name); }

  std::vector<std::string> supported() const {
    std::vector<std::string> out;
    for (const Build& b : builds_)
      if (b.supported()) out.push_back(b.name);
    return out;
  }

 private:
  const Build& pick(const std::string& name) const {
    for (const Build& b : builds_)
      if ((name == "auto" || name == b.name) && b.supported()) return b;
    std::string known;
    for (const std::string& s : supported()) known += ", " + s;
    args::fail(family_ + " ISA", "one of auto" + known + " (the ISAs available on this CPU)", "'" + name + "'");
  }

  std::vector<Build> builds_;
  std::string family_;
  const Build* active_ = nullptr;
};

}  // namespace paged::cpu
