// OpenMP, or its stand-ins where the build has none (PAGED_OPENMP=OFF, or
// Apple clang without Homebrew's libomp): every `#pragma omp` region then
// runs once, on the calling thread, and these functions give that one-thread
// team's answers, so the kernels' results are the same (they do not depend
// on the thread count, docs/kernels.md) and only the speed differs.
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
}
inline int omp_get_max_threads() { return 1; }
inline int omp_get_num_threads() { return 1; }
inline int omp_get_thread_num() { return 0; }
inline int omp_in_parallel() { return 0; }
inline void omp_set_num_threads(int) {}
inline void omp_set_dynamic(int) {}
enum omp_pause_resource_t { omp_pause_soft = 1, omp_pause_hard = 2 };
inline int omp_pause_resource_all(omp_pause_resource_t) { return 0; }
#endif
