// The CPU KV cache's memory (docs/block-pool.md, "KV memory on the CPU"):
// `stripes` tensors (each layer's keys and values) of `num_blocks` blocks of
// `block_bytes`, reserved as one HostArena (host_arena.h: NUMA node preferred
// with mbind, huge pages advised) with every stripe on a 2 MiB boundary.
//
// Nothing is committed up front: a block's pages become resident when a step
// writes it or, before that, when the pre-faulter reaches it. The block pool
// hands never-used blocks out in ascending id order, so "blocks [0, n) of
// every stripe are committed" is all the state there is: the engine asks for
// the blocks past the highest one written (prefault), a background thread
// commits them a chunk at a time, and a step finds its pages already there.
// Committing fills the page tables without changing a byte
// (MADV_POPULATE_WRITE; before Linux 5.14 an atomic add of zero per page), so
// it may race with the kernels writing the same block.
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arg_error.h"
#include "module.h"
#include "runtime/host_arena.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 (uapi/asm-generic/mman-common.h)
#endif

namespace nb = nanobind;

namespace paged::cpu {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kPage = 4096;  // the smallest page a write may fault

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Make [begin, end) resident and writable, leaving its contents as they are.
void commit_range(uint8_t* begin, uint8_t* end) {
  static std::atomic<bool> populate_write{true};  // false once the kernel refuses it (EINVAL: before 5.14)
  auto* first = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(begin) / kPage * kPage);
  if (end <= first) return;
  const size_t len = round_up(static_cast<size_t>(end - first), kPage);
  if (populate_write.load(std::memory_order_relaxed)) {
    if (madvise(first, len, MADV_POPULATE_WRITE) == 0) return;
    if (errno == EINVAL) populate_write.store(false, std::memory_order_relaxed);
  }
  // An atomic read-modify-write faults the page in writable without losing a
  // store a kernel makes to the same byte meanwhile.
  for (size_t i = 0; i < len; i += kPage) __atomic_fetch_add(first + i, uint8_t{0}, __ATOMIC_RELAXED);
}

using ByteArray = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

class KvArena {
 public:
  KvArena(int64_t stripes, int64_t num_blocks, int64_t block_bytes, int node, std::vector<int> cpus)
      : stripes_(stripes), num_blocks_(num_blocks), block_bytes_(block_bytes), cpus_(std::move(cpus)) {
    if (stripes <= 0) args::fail("stripes (KvArena)", "> 0", stripes);
    if (num_blocks <= 0) args::fail("num_blocks (KvArena)", "> 0", num_blocks);
    if (block_bytes <= 0) args::fail("block_bytes (KvArena)", "> 0", block_bytes);
    for (int cpu : cpus_)
      if (cpu < 0 || cpu >= CPU_SETSIZE) args::fail("cpus (KvArena)", "CPU ids in [0, " + std::to_string(CPU_SETSIZE) + ")", cpu);
    const auto limit = static_cast<int64_t>(1) << 50;  // 1 PiB: larger is a caller's mistake, not a cache
    if (num_blocks > limit / block_bytes || num_blocks * block_bytes > limit / stripes)
      args::fail("stripes x num_blocks x block_bytes (KvArena)", "at most 2^50 bytes",
                 std::to_string(stripes) + " x " + std::to_string(num_blocks) + " x " + std::to_string(block_bytes));
    stride_ = round_up(static_cast<size_t>(num_blocks * block_bytes), kHugePage);
    arena_ = std::make_shared<HostArena>(stride_ * static_cast<size_t>(stripes));
    numa_reason_ = arena_->prefer_node(node < 0 ? current_numa_node() : node);
  }

  ~KvArena() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();  // the stripes may outlive this object: the mapping stays theirs
  }
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  ByteArray stripe(int64_t i) const {
    if (i < 0 || i >= stripes_) args::fail_index("stripe (KvArena)", "an index in [0, " + std::to_string(stripes_) + ")", i);
    const size_t shape[1] = {static_cast<size_t>(num_blocks_ * block_bytes_)};
    // The array owns a share of the mapping, not this object: a tensor left
    // alive at interpreter exit holds memory, not a bound instance.
    auto* share = new std::shared_ptr<HostArena>(arena_);
    nb::capsule owner(share, [](void* p) noexcept { delete static_cast<std::shared_ptr<HostArena>*>(p); });
    return ByteArray(arena_->data() + static_cast<size_t>(i) * stride_, 1, shape, owner);
  }

  // Blocks [0, end) committed before this returns, split over the thread team.
  void commit(int64_t end) {
    check_end("commit", end);
    const int64_t from = committed_.load();
    if (end <= from) return;
    parallel_for(stripes_, true, Schedule::Static, 1, [&](int64_t s) { commit_stripe(s, from, end); });
    raise_committed(end);
  }

  // Blocks [0, min(end, num_blocks)) committed soon by the pre-faulter
  // thread (started on the first call); returns at once.
  void prefault(int64_t end) {
    if (end < 0) args::fail("end (KvArena.prefault)", ">= 0", end);
    end = std::min(end, num_blocks_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (end <= target_) return;
      target_ = end;
      if (!thread_.joinable()) thread_ = std::thread([this] { prefaulter(); });
    }
    cv_.notify_one();
  }

  // Blocks the pre-faulter (or commit) has made resident in every stripe.
  int64_t committed_blocks() const { return committed_.load(); }

  // Bytes of the reservation resident now, as the kernel reports (mincore):
  // committed blocks plus anything a step wrote past them, at page grain.
  int64_t resident_bytes() const {
    constexpr size_t kChunkPages = 1 << 16;
    std::vector<unsigned char> vec(kChunkPages);
    int64_t pages = 0;
    const size_t total = arena_->size();
    for (size_t off = 0; off < total; off += kChunkPages * kPage) {
      const size_t len = std::min(total - off, kChunkPages * kPage);
      if (mincore(arena_->data() + off, len, vec.data()) != 0) return -1;
      for (size_t p = 0; p < len / kPage; ++p) pages += vec[p] & 1;
    }
    return pages * static_cast<int64_t>(kPage);
  }

  int64_t reserved_bytes() const { return static_cast<int64_t>(arena_->size()); }
  int64_t num_stripes() const { return stripes_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_bytes() const { return block_bytes_; }
  const std::string& numa_reason() const { return numa_reason_; }

 private:
  void check_end(const char* call, int64_t end) const {
    if (end < 0 || end > num_blocks_)
      args::fail(std::string("end (KvArena.") + call + ")", "a block count in [0, " + std::to_string(num_blocks_) + "]", end);
  }

  void commit_stripe(int64_t s, int64_t from, int64_t to) {
    uint8_t* base = arena_->data() + static_cast<size_t>(s) * stride_;
    commit_range(base + from * block_bytes_, base + to * block_bytes_);
  }

  void raise_committed(int64_t end) {
    int64_t seen = committed_.load();
    while (seen < end && !committed_.compare_exchange_weak(seen, end)) {
    }
  }

  // The background thread: commits up to target_ a chunk at a time (about a
  // huge page of every stripe), so a stop or a new target is seen promptly.
  // It runs on every CPU of the team (a thread started from the pinned
  // engine thread would otherwise share its one CPU) and never opens a
  // parallel region of its own.
  void prefaulter() {
#if defined(__linux__)
    if (!cpus_.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int cpu : cpus_) CPU_SET(cpu, &set);
      (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort: else the creator's CPUs
    }
#endif
    const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kHugePage) / block_bytes_);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || target_ > committed_.load(); });
      if (stop_) return;
      const int64_t from = committed_.load(), to = std::min(target_, from + chunk);
      lock.unlock();
      for (int64_t s = 0; s < stripes_; ++s) commit_stripe(s, from, to);
      raise_committed(to);
      lock.lock();
    }
  }

  int64_t stripes_, num_blocks_, block_bytes_;
  size_t stride_ = 0;
  std::vector<int> cpus_;
  std::shared_ptr<HostArena> arena_;
  std::string numa_reason_;
  std::atomic<int64_t> committed_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t target_ = 0;  // guarded by mu_
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;
};

}  // namespace

void register_kv_arena(nb::module_& m) {
  nb::class_<KvArena>(m, "KvArena",
                      "The CPU KV cache's memory: `stripes` zero-filled tensors of `num_blocks` blocks of "
                      "`block_bytes`, reserved at once (NUMA node preferred, huge pages advised) and committed "
                      "on demand: by writes, by commit(end) or by the background pre-faulter (prefault(end)).")
      .def(nb::init<int64_t, int64_t, int64_t, int, std::vector<int>>(), nb::arg("stripes"), nb::arg("num_blocks"),
           nb::arg("block_bytes"), nb::arg("node") = -1, nb::arg("cpus") = std::vector<int>{},
           "node -1: the calling thread's; cpus: where the pre-faulter runs (empty: the caller's CPUs).")
      .def("stripe", &KvArena::stripe, nb::arg("i"),
           "Stripe i as a uint8 DLPack array (it keeps the memory mapped; the pre-faulter stops with this object).")
      .def("commit", &KvArena::commit, nb::arg("end"), nb::call_guard<nb::gil_scoped_release>(),
           "Commit blocks [0, end) of every stripe now, on the thread team.")
      .def("prefault", &KvArena::prefault, nb::arg("end"), nb::call_guard<nb::gil_scoped_release>(),
           "Have the background pre-faulter commit blocks [0, min(end, num_blocks)); returns at once.")
      .def_prop_ro("committed_blocks", &KvArena::committed_blocks)
      .def("resident_bytes", &KvArena::resident_bytes, nb::call_guard<nb::gil_scoped_release>(),
           "Bytes of the reservation resident now (mincore), -1 if the kernel does not say.")
      .def_prop_ro("reserved_bytes", &KvArena::reserved_bytes)
      .def_prop_ro("num_stripes", &KvArena::num_stripes)
      .def_prop_ro("num_blocks", &KvArena::num_blocks)
      .def_prop_ro("block_bytes", &KvArena::block_bytes)
      .def_prop_ro("numa_reason", &KvArena::numa_reason, "'' when the node policy was applied, else why not.");
}

}  // namespace paged::cpu
