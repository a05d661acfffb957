// NUMA host arena for the CPU KV cache: one anonymous mmap per allocation
// (page-aligned, zero-filled by the kernel, huge pages advised), given a preferred-node memory
// policy with the mbind syscall before any page is touched, faulted in by
// the thread team at once (populate), and unmapped when the last
// Python/torch owner lets go (nanobind capsule owner, RAII).
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "arg_error.h"
#include "module.h"
#include "runtime/parallel.h"

namespace nb = nanobind;

namespace paged::cpu {
namespace {

constexpr int kMpolPreferred = 1;  // <linux/mempolicy.h> MPOL_PREFERRED
constexpr int kMaxNodes = 1024;

class HostArena {
 public:
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
  // a thread); and a machine short of memory fails at start, not mid-request.
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

int current_numa_node() {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0) return -1;
  return static_cast<int>(node);
}

using ByteArray = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// (zero-filled uint8 array of `nbytes`, "" or the reason the node policy was not applied)
std::pair<ByteArray, std::string> host_arena_zeros(int64_t nbytes, int node, bool populate) {
  if (nbytes <= 0) paged::args::fail("nbytes (host_arena_zeros)", "> 0", nbytes);
  auto arena = std::make_unique<HostArena>(static_cast<size_t>(nbytes));
  std::string why_not = arena->prefer_node(node < 0 ? current_numa_node() : node);
  if (populate) {
    nb::gil_scoped_release released;
    arena->populate();
  }
  uint8_t* data = arena->data();
  nb::capsule owner(arena.get(), [](void* p) noexcept { delete static_cast<HostArena*>(p); });
  arena.release();  // the capsule owns it now
  const size_t shape[1] = {static_cast<size_t>(nbytes)};
  return {ByteArray(data, 1, shape, owner), why_not};
}

}  // namespace

void register_host_arena(nb::module_& m) {
  m.def("host_arena_zeros", &host_arena_zeros, nb::arg("nbytes"), nb::arg("node") = -1, nb::arg("populate") = true,
        "Zero-filled page-aligned host memory preferring a NUMA node (-1: the calling thread's), its pages "
        "faulted in by the thread team unless populate=False. "
        "Returns (uint8 DLPack array, '' or why the node policy was not applied).");
  m.def("current_numa_node", &current_numa_node, "NUMA node of the CPU this thread runs on (-1 if unknown).");
}

}  // namespace paged::cpu
