// paged._C_ascend: whether the CANN runtime is usable here (acl_error).
// The NPU backend runs on torch_npu's memory and CANN operators, and block
// accounting is the host's (paged._C_cpu.BlockPool, docs/architecture.md),
// so nothing else is bound. CANN is loaded with dlopen on the first call,
// so this module imports on any machine.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "acl_runtime.h"

NB_MODULE(_C_ascend, m) {
  m.doc() = "paged Ascend host helpers (libascendcl.so loaded at run time)";
  m.def("acl_error", &paged::ascend::AclRuntime::probe,
        "'' when libascendcl.so loads, exports what paged needs and aclInit succeeds, else what is missing.");
}
