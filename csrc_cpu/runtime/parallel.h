// parallel_for: the loops the CPU kernels split over threads. With OpenMP it
// is exactly an OpenMP loop (schedule(static) or schedule(dynamic, chunk),
// `if (parallel)`); without OpenMP (PAGED_OPENMP=OFF, Apple clang without
// libomp) a pool of std::threads (parallel.cpp) runs the same iterations:
// static gives each thread one contiguous range, as OpenMP's static schedule
// does, dynamic hands out `chunk` iterations at a time. The kernels' results
// never depend on which thread runs an iteration (docs/kernels.md), so the
// two builds agree bit for bit; tests/test_kernel_drivers.py runs both.
#pragma once

#include <cstdint>
#include <functional>

#include "runtime/omp_compat.h"

namespace paged::cpu {

enum class Schedule { Static, Dynamic };

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
#if defined(_OPENMP)
  if (schedule == Schedule::Static) {
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
