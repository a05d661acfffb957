// A build of a CPU kernel family, and the run-time choice among the builds of
// a family chosen by name (attention, quantized linear, fused ops): "auto" =
// the best build this CPU runs, or a build by name; PAGED_CPU_ISA picks the
// initial one for every family that has a build of that name (tests and
// benchmarks use it). Build names are shared by every family: scalar (runs
// everywhere); on x86-64 avx2, avxvnni, avx512, amx; on aarch64 neon,
// dotprod, i8mm. The builds themselves, best first, are one table:
// kernel_builds.cpp.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "arg_error.h"

// The target architecture, as CMake picks the arch/ folder it compiles.
#if defined(__x86_64__)
#define PAGED_ISA_X86 1
#elif defined(__aarch64__)
#define PAGED_ISA_ARM64 1
#endif

namespace paged::cpu {

template <class Kernel>
struct Build {
  const char* name;     // the build's name (PAGED_CPU_ISA, set_*_isa)
  const char* level;    // the ISA level it belongs to (kernel_builds.h)
  Kernel kernel;
  bool (*supported)();  // this CPU, as PAGED_CPU_HIDE leaves it, runs the build
};

template <class Kernel>
class IsaSelector {
 public:
  using Build = paged::cpu::Build<Kernel>;

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
  const std::vector<Build>& builds() const { return builds_; }

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
