// paged._C_cpu's view of the kernel build table (kernel_builds.h), which
// backends/cpu/host/isa.py reads instead of keeping a ranking of its own.
#include <nanobind/stl/string.h>

#include "kernel_builds.h"
#include "module.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu {
void register_kernel_builds(nb::module_& m) {
  m.def(
      "kernel_builds",
      [] {
        nb::dict out;
        for (const FamilyState& f : kernel_families()) {
          nb::list builds;
          for (const BuildState& b : f.builds) {
            nb::dict d;
            d["name"] = b.name;
            d["level"] = b.level;
            d["runs"] = b.supported;
            d["active"] = b.active;
            builds.append(d);
          }
          nb::dict family;
          family["selectable"] = f.selectable;
          family["builds"] = builds;
          out[f.family.c_str()] = family;
        }
        return out;
      },
      "The kernel build table: family -> {'selectable': chosen by name (set_kernel_build, PAGED_CPU_ISA), "
      "'builds': best first, each {'name', 'level' (the ISA level it belongs to), 'runs' (this CPU, as "
      "PAGED_CPU_HIDE leaves it, runs it), 'active' (the build the family runs now)}}.");
  m.def("set_kernel_build", &set_kernel_build, "family"_a, "name"_a,
        "Choose a selectable family's build: 'auto' or one it runs (set_attention_isa and its siblings, by family).");
  m.def(
      "kernel_levels",
      [] {
        nb::list out;
        for (const Level& l : levels()) {
          nb::dict d;
          d["name"] = l.name;
          d["hides"] = l.hides;
          d["runs"] = l.supported();
          out.append(d);
        }
        return out;
      },
      "The ISA levels of this architecture, best first: each {'name', 'hides' (the PAGED_CPU_HIDE value that runs "
      "a process at this level), 'runs' (this CPU, as PAGED_CPU_HIDE leaves it, is of the level or newer)}.");
}
}  // namespace paged::cpu
