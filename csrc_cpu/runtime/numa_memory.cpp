// NUMA memory policy. libnuma is optional at run time (dlopen, no build
// dependency, no headers needed); without it the raw set_mempolicy syscall
// does the same job. A policy belongs to a thread, so it is applied on the
// caller and on every OpenMP thread (the ones that first-touch KV blocks).
#include <dlfcn.h>
#include "runtime/omp_compat.h"
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "arg_error.h"
#include "runtime/runtime.h"

namespace paged::cpu::runtime {
namespace {

// Values from <numaif.h> (kernel ABI), defined here so no header is needed.
constexpr int kMpolDefault = 0;
constexpr int kMpolPreferred = 1;
constexpr int kMpolBind = 2;
constexpr int kMpolModeFlags = (1 << 15) | (1 << 14) | (1 << 13);  // static/relative/numa-balancing
constexpr int kMaxNodes = 1024;
constexpr size_t kMaskWords = kMaxNodes / (sizeof(unsigned long) * CHAR_BIT);
using NodeMask = std::array<unsigned long, kMaskWords>;

const char* mode_name(int mode) {
  static const char* const names[] = {"default", "preferred", "bind", "interleave",
                                      "local", "preferred_many", "weighted_interleave"};
  return (mode >= 0 && mode < 7) ? names[mode] : "unknown";
}

// ---- libnuma, resolved at run time ----------------------------------------
struct Libnuma {
  struct Closer {
    void operator()(void* h) const { dlclose(h); }
  };
  std::unique_ptr<void, Closer> handle;
  int (*available)() = nullptr;
  int (*max_node)() = nullptr;
  void (*set_preferred)(int) = nullptr;
  void (*set_localalloc)() = nullptr;
  void* (*allocate_nodemask)() = nullptr;
  void* (*bitmask_setbit)(void*, unsigned int) = nullptr;
  void (*bitmask_free)(void*) = nullptr;
  void (*set_membind)(void*) = nullptr;

  template <typename F>
  bool resolve(F& fn, const char* name) {
    fn = reinterpret_cast<F>(dlsym(handle.get(), name));
    return fn != nullptr;
  }
  bool usable() const { return handle != nullptr; }
};

// Loaded once; an empty handle when libnuma is missing or unusable here.
const Libnuma& libnuma() {
  static const Libnuma lib = [] {
    Libnuma l;
    l.handle.reset(dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL));
    if (!l.handle) return l;
    const bool ok = l.resolve(l.available, "numa_available") && l.resolve(l.max_node, "numa_max_node") &&
                    l.resolve(l.set_preferred, "numa_set_preferred") &&
                    l.resolve(l.set_localalloc, "numa_set_localalloc") &&
                    l.resolve(l.allocate_nodemask, "numa_allocate_nodemask") &&
                    l.resolve(l.bitmask_setbit, "numa_bitmask_setbit") &&
                    l.resolve(l.bitmask_free, "numa_bitmask_free") &&
                    l.resolve(l.set_membind, "numa_set_membind");
    if (!ok || l.available() < 0) l.handle.reset();
    return l;
  }();
  return lib;
}

void apply_libnuma(const Libnuma& lib, int node, bool strict) {
  if (!strict) {
    lib.set_preferred(node);
    return;
  }
  std::unique_ptr<void, void (*)(void*)> mask(lib.allocate_nodemask(), lib.bitmask_free);
  lib.bitmask_setbit(mask.get(), static_cast<unsigned int>(node));
  lib.set_membind(mask.get());
}

// Returns 0 or an errno value.
int apply_syscall(int mode, int node) {
  NodeMask mask{};
  const unsigned long* mask_ptr = nullptr;
  if (node >= 0) {
    mask[static_cast<size_t>(node) / (sizeof(unsigned long) * CHAR_BIT)] |=
        1UL << (static_cast<size_t>(node) % (sizeof(unsigned long) * CHAR_BIT));
    mask_ptr = mask.data();
  }
#if defined(SYS_set_mempolicy)
  // The kernel reads maxnode - 1 bits (a long-standing quirk of this ABI).
  const long rc = syscall(SYS_set_mempolicy, mode, mask_ptr, mask_ptr ? kMaxNodes + 1 : 0);
  return rc == 0 ? 0 : errno;
#else  // no NUMA memory policy on this OS (macOS)
  return mode == kMpolDefault ? 0 : ENOSYS;
#endif
}

// Runs fn on the caller and on every thread of an OpenMP team of the
// current size; returns the first non-zero errno.
template <typename Fn>
int on_every_thread(Fn fn) {
  int first_error = fn();
  const int n = omp_get_max_threads();
  std::vector<int> errors(static_cast<size_t>(n), 0);
#pragma omp parallel num_threads(n)
  errors[static_cast<size_t>(omp_get_thread_num())] = fn();
  for (int e : errors)
    if (first_error == 0) first_error = e;
  return first_error;
}

}  // namespace

bool libnuma_available() { return libnuma().usable(); }

std::pair<std::string, std::vector<int>> memory_policy() {
  int mode = 0;
  NodeMask mask{};
#if defined(SYS_get_mempolicy)
  if (syscall(SYS_get_mempolicy, &mode, mask.data(), kMaxNodes, nullptr, 0UL) != 0)
    throw std::runtime_error(std::string("get_mempolicy failed: ") + std::strerror(errno));
#endif
  std::vector<int> nodes;
  for (int n = 0; n < kMaxNodes; ++n)
    if (mask[static_cast<size_t>(n) / (sizeof(unsigned long) * CHAR_BIT)] >>
            (static_cast<size_t>(n) % (sizeof(unsigned long) * CHAR_BIT)) & 1UL)
      nodes.push_back(n);
  return {mode_name(mode & ~kMpolModeFlags), nodes};
}

std::string bind_memory_to_node(int node, bool strict, MemoryMethod method) {
  if (node < 0 || node >= kMaxNodes)
    args::fail("node (bind_memory_to_node)", "in [0, " + std::to_string(kMaxNodes) + ")", node);
  const Libnuma& lib = libnuma();
  if (method == MemoryMethod::Libnuma && !lib.usable())
    throw std::runtime_error("bind_memory_to_node: libnuma.so.1 is not available (install libnuma1)");
  const bool use_libnuma = method != MemoryMethod::Syscall && lib.usable();
  const std::string expected_mode = strict ? "bind" : "preferred";

  if (use_libnuma) {
    if (node > lib.max_node())
      args::fail("node (bind_memory_to_node)", "an existing node (highest node is " + std::to_string(lib.max_node()) + ")",
                 node);
    on_every_thread([&] {
      apply_libnuma(lib, node, strict);
      return 0;
    });
    // libnuma only prints its failures, so check the outcome directly.
    const auto [mode, nodes] = memory_policy();
    if (mode != expected_mode || nodes != std::vector<int>{node})
      throw std::runtime_error("bind_memory_to_node: libnuma could not set a " + expected_mode +
                               " policy for node " + std::to_string(node) + " (policy is " + mode + ")");
    return "libnuma";
  }
  const int err = on_every_thread([&] { return apply_syscall(strict ? kMpolBind : kMpolPreferred, node); });
  if (err == EINVAL)
    args::fail("node (bind_memory_to_node)", "a memory node this process may use", node);
  if (err != 0)
    throw std::runtime_error("bind_memory_to_node: set_mempolicy failed for node " + std::to_string(node) +
                             ": " + std::strerror(err));
  return "set_mempolicy";
}

void reset_memory_policy() {
  const int err = on_every_thread([] { return apply_syscall(kMpolDefault, -1); });
  if (err != 0) throw std::runtime_error(std::string("set_mempolicy(MPOL_DEFAULT) failed: ") + std::strerror(err));
}

}  // namespace paged::cpu::runtime
