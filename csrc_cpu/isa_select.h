// Run-time choice among the SIMD builds of one CPU kernel family (attention,
// quantized linear, fused layer ops): "auto" = the best build this CPU can
// run, or a build by name; PAGED_CPU_ISA picks the initial one for every
// family that has a build of that name (tests and benchmarks use it).
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace paged::cpu {

inline bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

inline bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

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
    throw std::invalid_argument(family_ + " ISA '" + name + "' is not available on this CPU (available: auto" +
                                known + ")");
  }

  std::vector<Build> builds_;
  std::string family_;
  const Build* active_ = nullptr;
};

}  // namespace paged::cpu
