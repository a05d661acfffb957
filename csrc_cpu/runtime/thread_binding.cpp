// OpenMP thread pinning. Each thread pins itself from inside the parallel
// region: that is the only way to reach the pool's threads without knowing
// their OS ids, and libgomp reuses the same threads for later regions (torch
// shares this libgomp, so its intra-op threads are the pinned ones too).
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>

#include "arg_error.h"
#include "runtime/runtime.h"

namespace paged::cpu::runtime {
namespace {

struct InitialState {
  std::vector<int> allowed;  // the process's CPUs before any pinning
  int max_threads;           // OpenMP team size before any binding
};

std::vector<int> mask_to_list(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

const InitialState& initial_state() {
  static const InitialState state = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0)
      throw std::runtime_error(std::string("sched_getaffinity failed: ") + std::strerror(errno));
    return InitialState{mask_to_list(set), omp_get_max_threads()};
  }();
  return state;
}

// Runs in a team of `n` threads, each pinning itself to the mask that
// mask_for(thread) returns; throws naming the first thread that failed.
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
    const cpu_set_t set = mask_for(t);
    errors[static_cast<size_t>(t)] = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  if (team != n)
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
    if (c < 0 || c >= CPU_SETSIZE)
      args::fail("cpus (bind_threads)", "CPUs in [0, " + std::to_string(CPU_SETSIZE) + ")", "CPU " + std::to_string(c));
    if (!allowed_set.count(c))
      args::fail("cpus (bind_threads)", "CPUs allowed for this process", "CPU " + std::to_string(c) + " (not allowed)");
    if (!seen.insert(c).second)
      args::fail("cpus (bind_threads)", "distinct CPUs", "CPU " + std::to_string(c) + " listed twice");
  }
  pin_team(static_cast<int>(cpus.size()), [&](int t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[static_cast<size_t>(t)], &set);
    return set;
  });
}

void unbind_threads() {
  const InitialState& init = initial_state();
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c : init.allowed) CPU_SET(c, &all);
  pin_team(init.max_threads, [&](int) { return all; });
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
    cpu_set_t set;
    CPU_ZERO(&set);
    pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
    if (static_cast<size_t>(t) < report.size())
      report[static_cast<size_t>(t)] = ThreadInfo{t, sched_getcpu(), mask_to_list(set)};
  }
  report.resize(static_cast<size_t>(team));
  return report;
}

}  // namespace paged::cpu::runtime
