// Run-time choice of the attention kernel build (kernel_builds.h): the best
// ISA the CPU reports, overridable (tests, benchmarks) with set_isa /
// PAGED_CPU_ISA.
#include "attention/ops.h"
#include "kernel_builds.h"

namespace paged::cpu::attn {
namespace {

IsaSelector<AttentionKernel>& selector() { return attention_selector(); }

}  // namespace

std::string current_isa() { return selector().active().name; }
void set_isa(const std::string& name) { selector().set(name); }
std::vector<std::string> supported_isas() { return selector().supported(); }

void run_attention(const AttnArgs& a) { selector().active().kernel(a); }

}  // namespace paged::cpu::attn
