// CPU runtime: OpenMP thread pinning, NUMA memory policy and CPU feature
// detection. Pure C++ (no nanobind) so the logic can be driven from tests;
// bindings.cpp exposes it as paged._C_cpu.*. Errors are thrown as
// std::invalid_argument (bad input) or std::runtime_error (the OS refused).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace paged::cpu::runtime {

// ---- thread pinning (thread_binding.cpp) ----------------------------------

// What one OpenMP thread reports about itself, from inside the thread.
struct ThreadInfo {
  int thread;                 // omp_get_thread_num()
  int cpu;                    // sched_getcpu() at the time of the report
  std::vector<int> affinity;  // the thread's own affinity mask, sorted
};

// CPUs the process could use before any binding (captured once, the first
// time the runtime is touched, from the calling thread's mask).
const std::vector<int>& initial_allowed_cpus();

// Pin OpenMP thread i to cpus[i]; sets omp_set_num_threads(cpus.size()).
// Every CPU must be in initial_allowed_cpus() and listed once.
void bind_threads(const std::vector<int>& cpus);

// Undo bind_threads: every OpenMP thread (and the caller) gets the initial
// mask back and the team size returns to its count.
void unbind_threads();

// Free the calling thread's OpenMP worker pool (omp_pause_resource_all).
void release_thread_pool();

// One entry per thread of an OpenMP parallel region of the current size.
std::vector<ThreadInfo> thread_report();

// ---- NUMA memory policy (numa_memory.cpp) ---------------------------------

enum class MemoryMethod { Auto, Libnuma, Syscall };

// Prefer (or, when strict, require) memory from `node` for the calling thread
// and every OpenMP thread. Returns the method used: "libnuma" or
// "set_mempolicy". Auto tries libnuma.so.1 (dlopen) and falls back to the
// raw syscall.
std::string bind_memory_to_node(int node, bool strict, MemoryMethod method);

// Back to the default (local allocation) policy on the same threads.
void reset_memory_policy();

// The calling thread's policy: (mode name, nodes in the mask).
std::pair<std::string, std::vector<int>> memory_policy();

// Whether libnuma.so.1 can be loaded at run time.
bool libnuma_available();

// ---- CPU features (cpu_features.cpp) ---------------------------------------

// (feature name, usable) pairs: present, enabled by the OS and not hidden by
// PAGED_CPU_HIDE (a comma-separated list of feature names; "avx512" and "amx"
// name their families; hiding a feature hides what needs it). A bad
// PAGED_CPU_HIDE throws std::invalid_argument from every function here.
std::vector<std::pair<std::string, bool>> cpu_features();

// Features the hardware has that PAGED_CPU_HIDE hides.
std::vector<std::string> hidden_cpu_features();

// One feature by name (a name cpu_features() lists).
bool cpu_has(const std::string& name);

// The CPUID vendor string ("GenuineIntel", "AuthenticAMD", ...; "" off x86):
// for the few choices measured to differ by microarchitecture, not by ISA.
std::string cpu_vendor();

}  // namespace paged::cpu::runtime
