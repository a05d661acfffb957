// paged._C_cpu runtime functions: thread pinning, NUMA memory policy, CPU
// features. Arguments are validated in runtime/*.cpp; C++ exceptions become
// ValueError / RuntimeError through nanobind.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "arg_error.h"
#include "module.h"
#include "runtime/runtime.h"

namespace nb = nanobind;

namespace paged::cpu {
namespace {

runtime::MemoryMethod parse_method(const std::string& method) {
  if (method == "auto") return runtime::MemoryMethod::Auto;
  if (method == "libnuma") return runtime::MemoryMethod::Libnuma;
  if (method == "syscall") return runtime::MemoryMethod::Syscall;
  paged::args::fail("method (bind_memory_to_node)", "one of auto, libnuma, syscall", "'" + method + "'");
}

}  // namespace

void register_runtime(nb::module_& m) {
  runtime::initial_allowed_cpus();  // capture the process mask before anything pins

  m.def("bind_threads", &runtime::bind_threads, nb::arg("cpus"),
        "Pin OpenMP thread i to cpus[i] (from inside each thread) and set the team size to len(cpus).");
  m.def("unbind_threads", &runtime::unbind_threads,
        "Give every OpenMP thread the process's initial CPU mask and team size back.");
  m.def("release_thread_pool", &runtime::release_thread_pool,
        "Free the calling thread's OpenMP worker pool (before another thread takes over the work).");
  m.def("initial_allowed_cpus", &runtime::initial_allowed_cpus,
        "CPUs the process could use when paged._C_cpu was imported.");
  m.def(
      "thread_report",
      [] {
        nb::list out;
        for (const runtime::ThreadInfo& t : runtime::thread_report()) {
          nb::dict d;
          d["thread"] = t.thread;
          d["cpu"] = t.cpu;
          d["affinity"] = t.affinity;
          out.append(d);
        }
        return out;
      },
      "Each OpenMP thread's number, current CPU and affinity mask, reported from inside the thread.");
  m.def(
      "bind_memory_to_node",
      [](int node, bool strict, const std::string& method) {
        return runtime::bind_memory_to_node(node, strict, parse_method(method));
      },
      nb::arg("node"), nb::arg("strict") = false, nb::arg("method") = "auto",
      "Prefer (strict: require) memory from `node` on the caller and every OpenMP thread. "
      "Returns 'libnuma' or 'set_mempolicy'.");
  m.def("reset_memory_policy", &runtime::reset_memory_policy,
        "Back to the default memory policy on the caller and every OpenMP thread.");
  m.def(
      "memory_policy",
      [] {
        auto [mode, nodes] = runtime::memory_policy();
        nb::dict d;
        d["mode"] = mode;
        d["nodes"] = nodes;
        return d;
      },
      "The calling thread's memory policy: {'mode': ..., 'nodes': [...]}.");
  m.def("libnuma_available", &runtime::libnuma_available, "Whether libnuma.so.1 loads at run time.");
  m.def(
      "cpu_features",
      [] {
        nb::dict d;
        for (const auto& [name, present] : runtime::cpu_features()) d[name.c_str()] = present;
        return d;
      },
      "CPU features usable here (CPUID, OS-enabled state, minus PAGED_CPU_HIDE): avx2, avx512f, avx512bf16, ...");
  m.def("cpu_vendor", &runtime::cpu_vendor, "The CPUID vendor string ('GenuineIntel', 'AuthenticAMD'; '' off x86).");
  m.def("hidden_cpu_features", &runtime::hidden_cpu_features,
        "Features this CPU has that PAGED_CPU_HIDE hides from every kernel family.");
}

}  // namespace paged::cpu
