// Run-time choice of the attention kernel build: the best ISA the CPU reports,
// overridable (tests, benchmarks) with set_isa / PAGED_CPU_ISA.
#include "attention/ops.h"
#include "isa_select.h"

namespace paged::cpu::attn {
namespace {

using Kernel = void (*)(const AttnArgs&);

IsaSelector<Kernel>& selector() {
  static IsaSelector<Kernel> s({{"avx512", isa_avx512::attention, cpu_has_avx512},
                                {"avx2", isa_avx2::attention, cpu_has_avx2},
                                {"scalar", isa_scalar::attention, cpu_always}},
                               "attention");
  return s;
}

}  // namespace

std::string current_isa() { return selector().active().name; }
void set_isa(const std::string& name) { selector().set(name); }
std::vector<std::string> supported_isas() { return selector().supported(); }

void run_attention(const AttnArgs& a) { selector().active().kernel(a); }

}  // namespace paged::cpu::attn
