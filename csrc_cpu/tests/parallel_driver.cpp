// parallel_for (runtime/parallel.h) in whichever build this is: OpenMP, or
// the std::thread pool of a build without it (tests/test_kernel_drivers.py
// builds both). Every index runs exactly once under every schedule and any
// team size; a static schedule gives each thread one contiguous range (the
// int8 linear's prefetch relies on it), a balanced one too where its threads
// keep pace (else the others take its range's back); a nested loop runs
// inline; regions from several caller threads queue instead of mixing.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/parallel.h"
#include "tests/driver_util.h"

namespace {

using namespace paged::cpu;
using namespace paged::cpu::test;

void check_once(int threads, Schedule schedule, int64_t n, int64_t chunk) {
  omp_set_num_threads(threads);
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  std::vector<std::thread::id> who(static_cast<size_t>(n));
  parallel_for(n, true, schedule, chunk, [&](int64_t i) {
    hits[size_t(i)].fetch_add(1);
    who[size_t(i)] = std::this_thread::get_id();
  });
  for (int64_t i = 0; i < n; ++i)
    DRIVER_CHECK(hits[size_t(i)].load() == 1, "threads %d n %lld: index %lld ran %d times", threads, (long long)n,
                 (long long)i, hits[size_t(i)].load());
  if (schedule != Schedule::Static) return;
  std::map<std::thread::id, std::pair<int64_t, int64_t>> range;  // first, last index per thread
  std::map<std::thread::id, int64_t> count;
  for (int64_t i = 0; i < n; ++i) {
    auto it = range.emplace(who[size_t(i)], std::make_pair(i, i)).first;
    it->second.second = i;
    ++count[who[size_t(i)]];
  }
  for (const auto& [id, r] : range)
    DRIVER_CHECK(r.second - r.first + 1 == count[id], "static schedule: a thread's indices are not contiguous");
}

}  // namespace

int main() {
  std::printf("threads: %s\n", kHaveOpenMP ? "OpenMP" : "std::thread pool (no OpenMP)");
  const int hw = int(std::max(2u, std::thread::hardware_concurrency()));
  for (int threads : {1, 2, 3, hw})
    for (Schedule s : {Schedule::Static, Schedule::Dynamic, Schedule::Balanced})
      for (int64_t n : {0, 1, 2, 7, 1000})
        for (int64_t chunk : {1, 4}) check_once(threads, s, n, chunk);

  // Balanced: a slow iteration at the front of one thread's range holds up
  // nothing behind it (the other thread takes that range from the back; or,
  // where it got there first, the whole range): it finishes last, each index
  // still run once. A static schedule would run the range's rest after it.
  omp_set_num_threads(2);
  {
    const int64_t n = 64;
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::atomic<int64_t> done{0};
    parallel_for(n, true, Schedule::Balanced, 1, [&](int64_t i) {
      if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      hits[size_t(i)].fetch_add(1);
      order[size_t(i)] = done.fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) DRIVER_CHECK(hits[size_t(i)].load() == 1, "balanced: index %lld ran %d times",
                                                 (long long)i, hits[size_t(i)].load());
    DRIVER_CHECK(order[0] == n - 1, "balanced: %lld indices waited behind a slow one", (long long)(n - 1 - order[0]));
  }

  // A loop inside a loop's body runs (inline in the pool build) and completes.
  omp_set_num_threads(hw);
  std::atomic<int64_t> inner{0};
  parallel_for(8, true, Schedule::Dynamic, 1, [&](int64_t) {
    parallel_for(10, true, Schedule::Static, 1, [&](int64_t) { inner.fetch_add(1); });
  });
  DRIVER_CHECK(inner.load() == 80, "nested loops ran %lld inner iterations, expected 80", (long long)inner.load());

  // Regions opened by several threads at once each complete with their own body.
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 50; ++rep) {
        std::vector<int> out(64, -1);
        parallel_for(64, true, rep % 3 == 2 ? Schedule::Balanced : rep % 2 ? Schedule::Static : Schedule::Dynamic, 2,
                     [&](int64_t i) { out[size_t(i)] = c; });
        if (std::count(out.begin(), out.end(), c) != 64) bad.fetch_add(1);
      }
    });
  for (std::thread& t : callers) t.join();
  DRIVER_CHECK(bad.load() == 0, "%d concurrent regions left entries unset", bad.load());
  return finish("parallel_driver");
}
