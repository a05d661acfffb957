// OpenMP thread pinning. Each thread pins itself from inside the parallel
// region: that is the only way to reach the pool's threads without knowing
// their OS ids, and libgomp reuses the same threads for later regions (torch
// shares this libgomp, so its intra-op threads are the pinned ones too).
// Linux only; on macOS (no affinity API) nothing is pinned.
#include "runtime/omp_compat.h"
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>

#include "arg_error.h"
#include "runtime/runtime.h"

namespace paged::cpu::runtime {
namespace {

// The OS layer: Linux's affinity calls; elsewhere (macOS has no affinity
// API, docs/cpu.md) every CPU is allowed and pinning is a no-op.
#if defined(__linux__)
constexpr int kMaxCpus = CPU_SETSIZE;

std::vector<int> mask_to_list(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

std::vector<int> process_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0)
    throw std::runtime_error(std::string("sched_getaffinity failed: ") + std::strerror(errno));
  return mask_to_list(set);
}

// Pins the calling thread to `cpus`; 0 or the error number.
int pin_self(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

std::vector<int> own_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
  return mask_to_list(set);
}

int current_cpu() { return sched_getcpu(); }
#else
constexpr int kMaxCpus = 1024;

std::vector<int> process_cpus() {
  std::vector<int> cpus(std::max(1u, std::thread::hardware_concurrency()));
  for (size_t i = 0; i < cpus.size(); ++i) cpus[i] = int(i);
  return cpus;
}
int pin_self(const std::vector<int>&) { return 0; }
std::vector<int> own_affinity() { return process_cpus(); }
int current_cpu() { return -1; }
#endif

struct InitialState {
  std::vector<int> allowed;  // the process's CPUs before any pinning
  int max_threads;           // OpenMP team size before any binding
};

const InitialState& initial_state() {
  static const InitialState state{process_cpus(), omp_get_max_threads()};
  return state;
}

// Runs in a team of `n` threads, each pinning itself to the mask that
// mask_for(thread) returns; throws naming the first thread that failed.
// Without OpenMP (omp_compat.h) the team is the calling thread alone: it
// takes thread 0's mask, and the kernels run on it.
template <typename MaskFor>
void pin_team(int n, MaskFor mask_for) {
  omp_set_dynamic(0);
  omp_set_num_threads(n);
  std::vector<int> errors(static_cast<size_t>(n), 0);
  int team = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t == 0) team = omp_get_num_threads();
    errors[static_cast<size_t>(t)] = pin_self(mask_for(t));
  }
  if (team != (kHaveOpenMP ? n : 1))
    throw std::runtime_error("OpenMP started " + std::to_string(team) + " threads, " +
                             std::to_string(n) + " requested");
  for (int t = 0; t < n; ++t)
    if (errors[static_cast<size_t>(t)] != 0)
      throw std::runtime_error("pinning OpenMP thread " + std::to_string(t) +
                               " failed: " + std::strerror(errors[static_cast<size_t>(t)]));
}

}  // namespace

const std::vector<int>& initial_allowed_cpus() { return initial_state().allowed; }

void bind_threads(const std::vector<int>& cpus) {
  if (cpus.empty()) args::fail("cpus (bind_threads)", "a non-empty CPU list", "an empty one");
  const std::vector<int>& allowed = initial_allowed_cpus();
  const std::set<int> allowed_set(allowed.begin(), allowed.end());
  std::set<int> seen;
  for (int c : cpus) {
    if (c < 0 || c >= kMaxCpus)
      args::fail("cpus (bind_threads)", "CPUs in [0, " + std::to_string(kMaxCpus) + ")", "CPU " + std::to_string(c));
    if (!allowed_set.count(c))
      args::fail("cpus (bind_threads)", "CPUs allowed for this process", "CPU " + std::to_string(c) + " (not allowed)");
    if (!seen.insert(c).second)
      args::fail("cpus (bind_threads)", "distinct CPUs", "CPU " + std::to_string(c) + " listed twice");
  }
  pin_team(static_cast<int>(cpus.size()), [&](int t) { return std::vector<int>{cpus[static_cast<size_t>(t)]}; });
}

void unbind_threads() {
  const InitialState& init = initial_state();
  pin_team(init.max_threads, [&](int) { return init.allowed; });
}

void release_thread_pool() {
  // Frees the calling thread's OpenMP worker pool. libgomp nearly stops
  // spinning (and sleeps on a futex at every barrier) once it manages more
  // threads than there are CPUs, so a thread that hands its work to another
  // (the server's engine thread) must give its pool back first.
  omp_pause_resource_all(omp_pause_soft);
}

std::vector<ThreadInfo> thread_report() {
  std::vector<ThreadInfo> report(static_cast<size_t>(omp_get_max_threads()));
  int team = 0;
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    if (t == 0) team = omp_get_num_threads();
    if (static_cast<size_t>(t) < report.size())
      report[static_cast<size_t>(t)] = ThreadInfo{t, current_cpu(), own_affinity()};
  }
  report.resize(static_cast<size_t>(team));
  return report;
}

}  // namespace paged::cpu::runtime
