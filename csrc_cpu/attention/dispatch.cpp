// Run-time choice of the attention kernel build: the best ISA the CPU reports,
// overridable (tests, benchmarks) with set_isa / PAGED_CPU_ISA.
#include <cstdlib>
#include <stdexcept>

#include "attention/ops.h"

namespace paged::cpu::attn {
namespace {

using Kernel = void (*)(const AttnArgs&);
struct Isa {
  const char* name;
  Kernel kernel;
  bool (*supported)();
};

bool cpu_has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}
bool cpu_has_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool always() { return true; }

const Isa kIsas[] = {  // best first
    {"avx512", isa_avx512::attention, cpu_has_avx512},
    {"avx2", isa_avx2::attention, cpu_has_avx2},
    {"scalar", isa_scalar::attention, always},
};

const Isa* pick(const std::string& name) {
  for (const Isa& isa : kIsas)
    if ((name == "auto" || name == isa.name) && isa.supported()) return &isa;
  std::string known;
  for (const std::string& s : supported_isas()) known += " " + s;
  throw std::invalid_argument("attention ISA '" + name + "' is not available on this CPU (available: auto" + known + ")");
}

const Isa* initial() {
  const char* env = std::getenv("PAGED_CPU_ISA");
  if (env && *env) {
    try {
      return pick(env);
    } catch (const std::invalid_argument&) {  // fall back rather than fail at import
    }
  }
  return pick("auto");
}

const Isa*& active() {
  static const Isa* isa = initial();
  return isa;
}

}  // namespace

std::string current_isa() { return active()->name; }
void set_isa(const std::string& name) { active() = pick(name); }
std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const Isa& isa : kIsas)
    if (isa.supported()) out.push_back(isa.name);
  return out;
}

void run_attention(const AttnArgs& a) { active()->kernel(a); }

}  // namespace paged::cpu::attn
