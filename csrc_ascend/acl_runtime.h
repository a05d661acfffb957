// The ACL runtime, resolved from libascendcl.so with dlopen at first use:
// nothing links against CANN at build time (only torch-npu's headers are
// needed), and a machine without CANN gets a message saying what to install
// instead of an import error. Only the probe is bound (paged._C_ascend.acl_error):
// the NPU backend's memory and kernels are torch_npu's (docs/ascend.md).
#pragma once

#include <acl/acl_rt.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace paged::ascend {

// Loaded ACL entry points; throws std::runtime_error with the loader's
// message when libascendcl.so (or a symbol) is missing.
class AclRuntime {
 public:
  static const AclRuntime& get();

  // "" when libascendcl.so loads, exports what we need and aclInit succeeds; else why not.
  static std::string probe();

 private:
  AclRuntime();
  [[noreturn]] void fail(const char* what, aclError err) const;

  using InitFn = aclError (*)(const char*);
  using ErrMsgFn = const char* (*)();

  InitFn init_ = nullptr;
  ErrMsgFn err_msg_ = nullptr;
};

}  // namespace paged::ascend
