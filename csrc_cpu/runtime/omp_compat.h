// OpenMP, or its stand-ins where the build has none (PAGED_OPENMP=OFF, or
// Apple clang without Homebrew's libomp). Then the kernels' hot loops run on
// the std::thread pool of parallel_for (runtime/parallel.h), whose size these
// stand-ins report and set; any other `#pragma omp` region runs once, on the
// calling thread, as a one-thread team. Results are the same either way (they
// do not depend on the thread count, docs/kernels.md); only speed differs.
// tests/test_kernel_drivers.py builds and checks this configuration.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
namespace paged::cpu {
constexpr bool kHaveOpenMP = true;
}
#else
namespace paged::cpu {
constexpr bool kHaveOpenMP = false;
namespace pool {  // parallel.cpp
int size();
void set_size(int n);
bool inside();
}  // namespace pool
}  // namespace paged::cpu
inline int omp_get_max_threads() { return paged::cpu::pool::size(); }
inline void omp_set_num_threads(int n) { paged::cpu::pool::set_size(n); }
inline int omp_in_parallel() { return paged::cpu::pool::inside(); }
inline int omp_get_num_threads() { return 1; }  // inside a `#pragma omp parallel` that runs once
inline int omp_get_thread_num() { return 0; }
inline void omp_set_dynamic(int) {}
enum omp_pause_resource_t { omp_pause_soft = 1, omp_pause_hard = 2 };
inline int omp_pause_resource_all(omp_pause_resource_t) { return 0; }
#endif
