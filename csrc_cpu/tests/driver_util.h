// Shared by the kernel test drivers (kernel_*_driver.cpp): failure counting,
// a seeded generator, wall-clock timing, and the command line every driver
// takes: `family=build ...` asserts which build the selector picks on this
// CPU (so a run under qemu -cpu X proves the level it was meant to exercise).
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "isa_select.h"
#include "runtime/omp_compat.h"
#include "runtime/runtime.h"

namespace paged::cpu::test {

inline int& failures() {
  static int n = 0;
  return n;
}

#define DRIVER_CHECK(cond, ...)                                              \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fputc('\n', stderr);                                              \
      ++paged::cpu::test::failures();                                        \
    }                                                                        \
  } while (0)

inline std::mt19937& rng() {
  static std::mt19937 g(12345);
  return g;
}
inline float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng()); }
inline int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// "family=build" arguments: the build auto must pick for that family;
// "has=f1,f2" / "lacks=f1,f2": features the detector must (not) report.
inline std::map<std::string, std::string> expected_builds(int argc, char** argv) {
  std::map<std::string, std::string> out;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto eq = s.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "usage: %s [family=build ...]\n", argv[0]);
      std::exit(2);
    }
    out[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return out;
}

inline void check_features(const std::map<std::string, std::string>& expected) {
  std::printf("threads: %s\n", kHaveOpenMP ? "OpenMP" : "std::thread pool (no OpenMP)");
  std::printf("cpu features:");
  for (const auto& [name, on] : runtime::cpu_features()) std::printf(" %s%c", name.c_str(), on ? '+' : '-');
  std::printf("\n");
  for (const char* key : {"has", "lacks"}) {
    const auto it = expected.find(key);
    if (it == expected.end()) continue;
    std::string list = it->second + ",";
    for (size_t at; (at = list.find(',')) != std::string::npos; list.erase(0, at + 1)) {
      const std::string name = list.substr(0, at);
      if (name.empty()) continue;
      DRIVER_CHECK(runtime::cpu_has(name) == (std::string(key) == "has"), "feature %s: expected %s", name.c_str(),
                   key);
    }
  }
}

// Checks each supported build of `builds` (best first, scalar last) against
// the scalar one with compare(build, scalar) and the expected auto choice.
template <class Build, class Compare>
void check_family(const char* family, const std::vector<Build>& builds,
                  const std::map<std::string, std::string>& expected, Compare compare) {
  const Build& scalar = builds.back();
  std::string best;
  for (const Build& b : builds)
    if (b.supported() && best.empty()) best = b.name;
  std::printf("%s: auto picks %s\n", family, best.c_str());
  const auto want = expected.find(family);
  if (want != expected.end())
    DRIVER_CHECK(best == want->second, "%s: auto picks %s, expected %s", family, best.c_str(), want->second.c_str());
  for (const Build& b : builds) {
    if (&b == &scalar) continue;
    if (!b.supported()) {
      std::printf("%s %s: not supported by this CPU, skipped\n", family, b.name);
      continue;
    }
    const double t0 = now_ms();
    compare(b, scalar);
    std::printf("%s %s vs scalar: %.0f ms (both builds' runs)\n", family, b.name, now_ms() - t0);
  }
}

inline int finish(const char* name) {
  if (failures()) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", name, failures());
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}

}  // namespace paged::cpu::test
