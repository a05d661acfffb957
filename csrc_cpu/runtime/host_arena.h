// The NUMA host arena under the CPU KV cache: one anonymous private mmap
// (page-aligned, zero-filled by the kernel, huge pages advised), a
// preferred-node memory policy set with the mbind syscall before any page is
// touched, unmapped when the owner goes (RAII). host_arena.cpp binds it as
// numa_zeros' memory; kv_arena.cpp builds the KV cache's on-demand arena on it.
#pragma once

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "runtime/parallel.h"

namespace paged::cpu {

// NUMA node of the CPU the calling thread runs on (-1 if unknown).
int current_numa_node();

class HostArena {
 public:
  static constexpr int kMpolPreferred = 1;  // <linux/mempolicy.h> MPOL_PREFERRED
  static constexpr int kMaxNodes = 1024;

  explicit HostArena(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw std::runtime_error("host arena: mmap of " + std::to_string(bytes) + " bytes failed: " + std::strerror(errno));
    data_ = p;
    // Transparent huge pages where the kernel allows them (best effort: with
    // THP "never" or an old kernel this fails and 4 KiB pages still work).
    // Decode attention reads scattered KV blocks: one TLB entry per 2 MiB
    // instead of one per 4 KiB cut a bf16 decode call by ~20% in a harness.
    (void)madvise(p, bytes, MADV_HUGEPAGE);
  }
  ~HostArena() { munmap(data_, bytes_); }
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Prefer `node` for every page of the arena; "" on success, else why not.
  // The policy belongs to the mapping, so it holds whichever thread first
  // touches a page.
  std::string prefer_node(int node) {
    if (node < 0 || node >= kMaxNodes) return "node " + std::to_string(node) + " out of range";
    unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
    mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
#if defined(SYS_mbind)
    if (syscall(SYS_mbind, data_, bytes_, kMpolPreferred, mask, static_cast<unsigned long>(kMaxNodes + 1), 0) != 0)
      return std::string("mbind to node ") + std::to_string(node) + " failed: " + std::strerror(errno);
    return "";
#else
    return "no NUMA memory policy on this OS";
#endif
  }

  // Fault every page in now, split over the thread team. Left to first use,
  // each KV block's pages fault inside reshape_and_cache on the engine
  // thread while the rest of the team waits (4.6% of a fresh server's
  // 16-stream run on a 2-vCPU KVM guest, where a first touch runs at ~2 GB/s
  // a thread); the KV cache avoids that with its pre-faulter (kv_arena.cpp).
  void populate() {
    constexpr size_t kSlice = size_t{2} << 20;  // one huge page
    constexpr size_t kPage = 4096;              // the smallest page a write may fault
    const auto slices = static_cast<int64_t>((bytes_ + kSlice - 1) / kSlice);
    volatile uint8_t* bytes = data();
    parallel_for(slices, true, Schedule::Static, 1, [&](int64_t s) {
      const size_t begin = static_cast<size_t>(s) * kSlice, end = std::min(bytes_, begin + kSlice);
      for (size_t i = begin; i < end; i += kPage) bytes[i] = 0;
    });
  }

  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

}  // namespace paged::cpu
