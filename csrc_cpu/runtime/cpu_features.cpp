// The one CPU-feature detector, minus the features PAGED_CPU_HIDE names.
// x86: CPUID checked against what the OS enabled in XCR0 (a CPU with AVX-512
// whose kernel does not save ZMM state, or has not granted AMX tile state,
// cannot use those instructions). aarch64: the kernel's HWCAP words on Linux
// (getauxval, which is also what qemu-user emulates per -cpu), sysctl's
// hw.optional.arm.* on macOS. Every kernel family's ISA choice (kernel_builds.cpp)
// and the Python side (dtype choice, `paged env`) ask this detector, so hiding
// a feature moves the whole process to the older generation's paths.
#include "runtime/runtime.h"

#include "arg_error.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define PAGED_CPU_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define PAGED_CPU_ARM64 1
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#define PAGED_CPU_ARM64 1
#endif

namespace paged::cpu::runtime {
namespace {

// What each feature needs: hiding a feature hides everything that needs it
// (hiding avx2 leaves scalar builds only; hiding avx512f hides every AVX-512
// extension and AMX, the "Zen 3 / Skylake-client" generation; hiding asimd
// leaves an aarch64 CPU the scalar builds). Both architectures' names are
// known everywhere (a name of the other one is simply absent), so one
// PAGED_CPU_HIDE value and one kernel table work on either; cpu_features()
// lists the running architecture's.
enum class Arch { X86, Arm64 };
struct Feature {
  const char* name;
  const char* needs;  // nullptr: nothing we detect
  Arch arch;
};
constexpr Arch X = Arch::X86, A = Arch::Arm64;
constexpr Feature kFeatures[] = {
    {"avx2", nullptr, X},       {"fma", "avx2", X},          {"f16c", "avx2", X},
    {"avxvnni", "avx2", X},     {"avx512f", "avx2", X},      {"avx512bw", "avx512f", X},
    {"avx512vl", "avx512f", X}, {"avx512dq", "avx512f", X},  {"avx512vnni", "avx512f", X},
    {"avx512bf16", "avx512f", X}, {"avx512fp16", "avx512f", X}, {"amx_tile", "avx512f", X},
    {"amx_bf16", "amx_tile", X}, {"amx_int8", "amx_tile", X},
    // aarch64, named as /proc/cpuinfo does except dotprod (asimddp) and fp16 (asimdhp)
    {"asimd", nullptr, A},      {"fp16", "asimd", A},        {"dotprod", "asimd", A},
    {"i8mm", "asimd", A},       {"bf16", "asimd", A},        {"sve", "asimd", A},
    {"sve2", "sve", A},
};
#if defined(PAGED_CPU_ARM64)
constexpr Arch kArch = Arch::Arm64;
#else
constexpr Arch kArch = Arch::X86;  // and every other CPU: nothing detected, scalar builds
#endif
// Names PAGED_CPU_HIDE also takes for a family of features.
constexpr std::pair<const char*, const char*> kAliases[] = {
    {"avx512", "avx512f"}, {"amx", "amx_tile"}, {"neon", "asimd"}};

#if defined(__x86_64__) || defined(__i386__)
struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Regs{};
  return r;
}

bool bit(unsigned reg, int n) { return (reg >> n) & 1U; }

unsigned long long xcr0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

#if defined(PAGED_CPU_ARM64) && defined(__linux__)
void detect_arm64(std::map<std::string, bool>& f) {
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f["asimd"] = hw & HWCAP_ASIMD;
  f["fp16"] = hw & HWCAP_ASIMDHP;
  f["dotprod"] = hw & HWCAP_ASIMDDP;
  f["sve"] = hw & HWCAP_SVE;
  f["sve2"] = hw2 & HWCAP2_SVE2;
  f["i8mm"] = hw2 & HWCAP2_I8MM;
  f["bf16"] = hw2 & HWCAP2_BF16;
}
#elif defined(PAGED_CPU_ARM64)  // macOS (Apple Silicon): compiled nowhere in CI, see docs/cpu.md
bool sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof(value);
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
void detect_arm64(std::map<std::string, bool>& f) {
  f["asimd"] = true;  // every Apple Silicon core
  f["fp16"] = sysctl_flag("hw.optional.arm.FEAT_FP16");
  f["dotprod"] = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  f["i8mm"] = sysctl_flag("hw.optional.arm.FEAT_I8MM");
  f["bf16"] = sysctl_flag("hw.optional.arm.FEAT_BF16");
}
#endif

// The hardware's answer, before any hiding.
std::map<std::string, bool> detect() {
  std::map<std::string, bool> f;
  for (const Feature& x : kFeatures) f[x.name] = false;
#if defined(__x86_64__) || defined(__i386__)
  const Regs leaf1 = cpuid(1, 0);
  const bool osxsave = bit(leaf1.ecx, 27);
  const unsigned long long xcr = osxsave ? xcr0() : 0;
  const bool ymm_os = (xcr & 0x6) == 0x6;              // SSE + AVX state
  const bool zmm_os = ymm_os && (xcr & 0xe0) == 0xe0;  // opmask + ZMM state
  const bool tile_os = (xcr & 0x60000) == 0x60000;     // XTILECFG + XTILEDATA
  const Regs leaf7 = cpuid(7, 0);
  const Regs leaf7_1 = leaf7.eax >= 1 ? cpuid(7, 1) : Regs{};
  f["avx2"] = ymm_os && bit(leaf7.ebx, 5);
  f["fma"] = ymm_os && bit(leaf1.ecx, 12);
  f["f16c"] = ymm_os && bit(leaf1.ecx, 29);
  f["avxvnni"] = ymm_os && bit(leaf7_1.eax, 4);
  f["avx512f"] = zmm_os && bit(leaf7.ebx, 16);
  f["avx512dq"] = zmm_os && bit(leaf7.ebx, 17);
  f["avx512bw"] = zmm_os && bit(leaf7.ebx, 30);
  f["avx512vl"] = zmm_os && bit(leaf7.ebx, 31);
  f["avx512vnni"] = zmm_os && bit(leaf7.ecx, 11);
  f["avx512fp16"] = zmm_os && bit(leaf7.edx, 23);
  f["avx512bf16"] = zmm_os && bit(leaf7_1.eax, 5);
  f["amx_tile"] = tile_os && bit(leaf7.edx, 24);
  f["amx_bf16"] = tile_os && bit(leaf7.edx, 22);
  f["amx_int8"] = tile_os && bit(leaf7.edx, 25);
#elif defined(PAGED_CPU_ARM64)
  detect_arm64(f);
#endif
  return f;
}

std::string known_names() {
  std::string s = "avx512, amx, neon";
  for (const Feature& x : kFeatures) s += std::string(", ") + x.name;
  return s;
}

// PAGED_CPU_HIDE ("avx512", "avx512bf16,avx512vnni", ...) as feature names.
std::set<std::string> hidden_names(const char* env) {
  std::set<std::string> out;
  std::stringstream items(env ? env : "");
  for (std::string item; std::getline(items, item, ',');) {
    const auto first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    if (first == std::string::npos) continue;
    std::string name = item.substr(first, last - first + 1);
    for (const auto& [alias, target] : kAliases)
      if (name == alias) name = target;
    bool known = false;
    for (const Feature& x : kFeatures) known = known || name == x.name;
    if (!known)
      throw std::invalid_argument("PAGED_CPU_HIDE: expected a comma-separated list of " + known_names() +
                                  ", got '" + item + "'");
    out.insert(name);
  }
  return out;
}

// A feature is hidden when it or anything it needs is hidden, or it is absent.
std::map<std::string, bool> apply_hiding(std::map<std::string, bool> f, const std::set<std::string>& hide) {
  for (const Feature& x : kFeatures) {  // kFeatures lists each feature after what it needs
    const bool needs_ok = x.needs == nullptr || f[x.needs];
    f[x.name] = f[x.name] && needs_ok && hide.count(x.name) == 0;
  }
  return f;
}

struct State {
  std::map<std::string, bool> hardware = detect();
  std::set<std::string> hidden = hidden_names(std::getenv("PAGED_CPU_HIDE"));
  std::map<std::string, bool> visible = apply_hiding(hardware, hidden);
};

const State& state() {
  static const State s;  // a bad PAGED_CPU_HIDE throws here, on every call, as a ValueError
  return s;
}

}  // namespace

std::vector<std::pair<std::string, bool>> cpu_features() {
  std::vector<std::pair<std::string, bool>> out;
  for (const Feature& x : kFeatures)
    if (x.arch == kArch) out.emplace_back(x.name, state().visible.at(x.name));
  if (kArch == Arch::X86) out.emplace_back("amx", state().visible.at("amx_bf16"));  // the older name
  return out;
}

std::vector<std::string> hidden_cpu_features() {
  std::vector<std::string> out;
  for (const Feature& x : kFeatures)
    if (state().hardware.at(x.name) && !state().visible.at(x.name)) out.emplace_back(x.name);
  return out;
}

std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  const Regs r = cpuid(0, 0);
  char name[13] = {};
  std::memcpy(name, &r.ebx, 4);
  std::memcpy(name + 4, &r.edx, 4);
  std::memcpy(name + 8, &r.ecx, 4);
  return name;
#else
  return "";
#endif
}

bool cpu_has(const std::string& name) {
  const auto it = state().visible.find(name);
  if (it == state().visible.end()) {
    std::string names;
    for (const Feature& x : kFeatures) names += std::string(names.empty() ? "" : ", ") + x.name;
    args::fail("name (cpu_has)", "one of " + names, "'" + name + "'");
  }
  return it->second;
}

}  // namespace paged::cpu::runtime
