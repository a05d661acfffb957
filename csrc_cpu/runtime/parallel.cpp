// The std::thread pool behind parallel_for where the build has no OpenMP
// (parallel.h). Workers start on the first region that needs them and live
// until exit; a region wakes them through one condition variable (a
// generation counter), the caller works as thread 0, and the region ends when
// every worker has reported back. Pinning (runtime/thread_binding.cpp) reaches
// only the caller in this build: the pool's threads run where the OS puts them.
#include "runtime/parallel.h"

#if !defined(_OPENMP)
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace paged::cpu::pool {
namespace {

thread_local bool t_inside = false;

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  int size() const { return size_.load(); }
  void set_size(int n) { size_.store(std::max(1, n)); }

  void run(int64_t n, Schedule schedule, int64_t chunk, const std::function<void(int64_t)>& body) {
    std::lock_guard<std::mutex> one_region(region_mutex_);
    const int team = int(std::min<int64_t>(size(), n));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (int(workers_.size()) < team - 1) {
        const int index = int(workers_.size()) + 1;
        workers_.emplace_back([this, index] { worker(index); });
      }
      balanced_.reset();
      if (schedule == Schedule::Balanced) balanced_ = std::make_unique<BalancedRanges>(n, team);
      task_ = Task{n, schedule, std::max<int64_t>(1, chunk), &body, team};
      next_.store(0);
      pending_ = team - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  struct Task {
    int64_t n = 0;
    Schedule schedule = Schedule::Static;
    int64_t chunk = 1;
    const std::function<void(int64_t)>* body = nullptr;
    int team = 1;
  };

  void work(int index) {
    t_inside = true;
    const Task& t = task_;
    if (t.schedule == Schedule::Balanced) {
      balanced_->run(index, *t.body);
    } else if (t.schedule == Schedule::Static) {  // contiguous ranges, as OpenMP's static schedule
      const int64_t lo = t.n * index / t.team, hi = t.n * (index + 1) / t.team;
      for (int64_t i = lo; i < hi; ++i) (*t.body)(i);
    } else {
      for (int64_t lo; (lo = next_.fetch_add(t.chunk)) < t.n;)
        for (int64_t i = lo; i < std::min(t.n, lo + t.chunk); ++i) (*t.body)(i);
    }
    t_inside = false;
  }

  void worker(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= task_.team) continue;  // not in this region's team
      lock.unlock();
      work(index);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex region_mutex_;  // one region at a time
  std::mutex mutex_;         // guards everything below but next_ and size_
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  Task task_;
  std::unique_ptr<BalancedRanges> balanced_;  // Schedule::Balanced's, for the region running
  std::atomic<int64_t> next_{0};
  std::atomic<int> size_{int(std::max(1u, std::thread::hardware_concurrency()))};
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void run(int64_t n, Schedule schedule, int64_t chunk, const std::function<void(int64_t)>& body) {
  pool().run(n, schedule, chunk, body);
}
int size() { return pool().size(); }
void set_size(int n) { pool().set_size(n); }
bool inside() { return t_inside; }

}  // namespace paged::cpu::pool
#endif
