// numa_zeros' memory: one HostArena (host_arena.h) per allocation, faulted
// in by the thread team at once (populate) unless asked not to, and unmapped
// when the last Python/torch owner lets go (nanobind capsule owner, RAII).
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
#include "runtime/host_arena.h"

namespace nb = nanobind;

namespace paged::cpu {

int current_numa_node() {
  unsigned cpu = 0, node = 0;
  if (syscall(SYS_getcpu, &cpu, &node, nullptr) != 0) return -1;
  return static_cast<int>(node);
}

namespace {

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
