// paged._C_ascend: the NPU block pool (shared accounting + an ACL device arena).
// CANN is loaded with dlopen when device memory is first reserved, so this
// module imports on any machine.
#include <nanobind/nanobind.h>

#include "block_pool_bindings.h"
#include "npu_block_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_C_ascend, m) {
  m.doc() = "paged Ascend NPU block pool (ACL device memory, libascendcl.so loaded at run time)";
  m.attr("DEVICE_ALIGNMENT") = paged::ascend::kDeviceAlignment;
  m.def("acl_error", &paged::ascend::AclRuntime::probe,
        "'' when libascendcl.so loads and exports what the pool needs, else what is missing.");
  m.def("block_stride", &paged::ascend::block_stride, "num_blocks"_a, "block_bytes"_a,
        "Bytes between consecutive blocks in the device arena (block_bytes aligned up).");
  paged::bind_block_hash(m);
  paged::bind_block_pool<paged::ascend::NpuBlockPool>(m, "BlockPool")
      .def("reserve_device_memory", &paged::ascend::NpuBlockPool::reserve_device_memory, "block_bytes"_a,
           "device"_a = 0, "Allocate the device arena (num_blocks x aligned block_bytes) with aclrtMalloc.")
      .def_prop_ro("has_device_memory", &paged::ascend::NpuBlockPool::has_device_memory)
      .def_prop_ro("block_stride", &paged::ascend::NpuBlockPool::block_stride)
      .def_prop_ro("device_bytes", &paged::ascend::NpuBlockPool::device_bytes)
      .def_prop_ro("device", &paged::ascend::NpuBlockPool::device)
      .def("block_address", &paged::ascend::NpuBlockPool::block_address, "block"_a,
           "Device address of the block's first byte.");
}
