// parallel_for: the loops the CPU kernels split over threads. With OpenMP it
// is exactly an OpenMP loop (schedule(static) or schedule(dynamic, chunk),
// `if (parallel)`); without OpenMP (PAGED_OPENMP=OFF, Apple clang without
// libomp) a pool of std::threads (parallel.cpp) runs the same iterations:
// static gives each thread one contiguous range, as OpenMP's static schedule
// does, dynamic hands out `chunk` iterations at a time. The kernels' results
// never depend on which thread runs an iteration (docs/kernels.md), so the
// two builds agree bit for bit; tests/test_kernel_drivers.py runs both.
//
// Schedule::Balanced is static's ranges, each run front to back by its
// thread, then evened out: a thread done with its own range takes the other
// ranges' last iterations, one at a time from the back (BalancedRanges).
// The matrix kernels prefetch a thread's next items (static's order) and
// stream its range from memory; their two threads do not always run at the
// same speed (a shared machine; Zen 4, 1B Q4_K_M decode: the one that also
// runs the serial work took ~14% longer on the same items).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/omp_compat.h"

namespace paged::cpu {

enum class Schedule { Static, Dynamic, Balanced };

// One region's ranges for Schedule::Balanced: team contiguous ranges of
// [0, n) as schedule(static) splits it, each a (front, back) pair in one
// atomic word; the owner takes its front, others take its back. Every
// iteration runs exactly once, whichever thread takes it.
class BalancedRanges {
 public:
  BalancedRanges(int64_t n, int team) : ranges_(size_t(team)) {
    for (int t = 0; t < team; ++t)
      ranges_[size_t(t)].word.store(pack(uint32_t(n * t / team), uint32_t(n * (t + 1) / team)));
  }
  // Thread `index`'s share: its own range front to back, then the others' backs.
  template <class Body>
  void run(int index, Body&& body) {
    const int team = int(ranges_.size());
    drain(ranges_[size_t(index)], true, body);
    for (int k = 1; k < team; ++k) drain(ranges_[size_t((index + k) % team)], false, body);
  }
  // n must fit the packed words
  static bool fits(int64_t n) { return n < (int64_t(1) << 32); }

 private:
  struct alignas(64) Range {  // a line each: the owner's takes do not contend
    std::atomic<uint64_t> word{0};
  };
  static uint64_t pack(uint32_t front, uint32_t back) { return uint64_t(back) << 32 | front; }
  template <class Body>
  static void drain(Range& r, bool front, Body& body) {
    uint64_t v = r.word.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t f = uint32_t(v), b = uint32_t(v >> 32);
      if (f >= b) return;
      const uint32_t i = front ? f : b - 1;
      if (r.word.compare_exchange_weak(v, front ? pack(f + 1, b) : pack(f, b - 1), std::memory_order_acq_rel)) {
        body(int64_t(i));
        v = r.word.load(std::memory_order_acquire);
      }
    }
  }
  std::vector<Range> ranges_;
};

#if !defined(_OPENMP)
namespace pool {
// body(i) for every i in [0, n) on min(size(), n) threads, the caller one of
// them; returns when all are done. One region at a time (callers queue).
// size() (threads per region, the caller included; hardware_concurrency() at
// start, set through omp_set_num_threads) and inside() (the calling thread
// runs a region's iterations: nested loops run serially) are declared in
// omp_compat.h.
void run(int64_t n, Schedule schedule, int64_t chunk, const std::function<void(int64_t)>& body);
}  // namespace pool
#endif

template <class Body>
void parallel_for(int64_t n, bool parallel, Schedule schedule, int64_t chunk, Body&& body) {
  if (n <= 1) {  // no team for a single iteration
    if (n == 1) body(0);
    return;
  }
  if (schedule == Schedule::Balanced && !BalancedRanges::fits(n)) schedule = Schedule::Static;
#if defined(_OPENMP)
  if (schedule == Schedule::Balanced) {
    const int team = int(std::min<int64_t>(omp_get_max_threads(), n));
    if (!parallel || team <= 1 || omp_in_parallel()) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    BalancedRanges ranges(n, team);  // a smaller team than asked leaves ranges to the others' stealing
#pragma omp parallel num_threads(team)
    ranges.run(omp_get_thread_num() % team, body);
  } else if (schedule == Schedule::Static) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
#pragma omp parallel for schedule(dynamic, chunk) if (parallel)
    for (int64_t i = 0; i < n; ++i) body(i);
  }
#else
  if (!parallel || pool::size() <= 1 || pool::inside()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  pool::run(n, schedule, chunk, std::function<void(int64_t)>(std::ref(body)));
#endif
}

}  // namespace paged::cpu
