// The few ACL runtime calls the NPU block pool needs, resolved from
// libascendcl.so with dlopen at first use: nothing links against CANN at
// build time (only torch-npu's headers are needed), and a machine without
// CANN gets a RuntimeError saying what to install instead of an import error.
#pragma once

#include <acl/acl_rt.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace paged::ascend {

// Every block start in the device arena is a multiple of this many bytes
// (the CANN operators read 32-byte aligned vectors; 512 keeps blocks on
// whole cache lines of the device's memory transactions).
inline constexpr size_t kDeviceAlignment = 512;

// Loaded ACL entry points; throws std::runtime_error with the loader's
// message when libascendcl.so (or a symbol) is missing.
class AclRuntime {
 public:
  static const AclRuntime& get();

  // ok == true when libascendcl.so loads and exports what we need; else reason.
  static std::string probe();

  void set_device(int32_t device) const;
  void* malloc(size_t bytes) const;
  void free(void* ptr) const noexcept;

 private:
  AclRuntime();
  [[noreturn]] void fail(const char* what, aclError err) const;

  using InitFn = aclError (*)(const char*);
  using SetDeviceFn = aclError (*)(int32_t);
  using MallocFn = aclError (*)(void**, size_t, aclrtMemMallocPolicy);
  using FreeFn = aclError (*)(void*);
  using ErrMsgFn = const char* (*)();

  InitFn init_ = nullptr;
  SetDeviceFn set_device_ = nullptr;
  MallocFn malloc_ = nullptr;
  FreeFn free_ = nullptr;
  ErrMsgFn err_msg_ = nullptr;
};

}  // namespace paged::ascend
