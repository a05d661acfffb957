#include "acl_runtime.h"

#include <dlfcn.h>

#include <memory>
#include <stdexcept>

namespace paged::ascend {
namespace {

constexpr const char* kLibrary = "libascendcl.so";
constexpr const char* kSetEnvHint = "source /usr/local/Ascend/ascend-toolkit/set_env.sh";

struct DlCloser {
  void operator()(void* handle) const noexcept { dlclose(handle); }
};
using LibraryHandle = std::unique_ptr<void, DlCloser>;

LibraryHandle open_library() {
  LibraryHandle handle(dlopen(kLibrary, RTLD_NOW | RTLD_GLOBAL));
  if (!handle) {
    const char* err = dlerror();
    throw std::runtime_error(std::string("CANN runtime library ") + kLibrary + " could not be loaded (" +
                             (err ? err : "unknown error") + "): " + kSetEnvHint);
  }
  return handle;
}

template <class Fn>
Fn symbol(void* handle, const char* name) {
  void* sym = dlsym(handle, name);
  if (!sym)
    throw std::runtime_error(std::string(kLibrary) + " has no symbol " + name +
                             " (CANN too old for torch-npu 2.13.0?)");
  return reinterpret_cast<Fn>(sym);
}

}  // namespace

AclRuntime::AclRuntime() {
  // Kept open for the life of the process (torch_npu holds the same library).
  static LibraryHandle library = open_library();
  void* h = library.get();
  init_ = symbol<InitFn>(h, "aclInit");
  err_msg_ = symbol<ErrMsgFn>(h, "aclGetRecentErrMsg");
  const aclError err = init_(nullptr);
  if (err != ACL_SUCCESS && err != ACL_ERROR_REPEAT_INITIALIZE) fail("aclInit", err);  // torch_npu may have run it
}

const AclRuntime& AclRuntime::get() {
  static const AclRuntime runtime;  // a failed load throws and is retried next call
  return runtime;
}

std::string AclRuntime::probe() {
  try {
    get();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void AclRuntime::fail(const char* what, aclError err) const {
  const char* msg = err_msg_ ? err_msg_() : nullptr;
  throw std::runtime_error(std::string(what) + " failed with ACL error " + std::to_string(err) +
                           (msg && *msg ? std::string(": ") + msg : std::string()));
}

}  // namespace paged::ascend
