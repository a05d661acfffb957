// The NPU block pool: the shared accounting (csrc_shared/block_allocator.h)
// plus, once reserved, one device arena from aclrtMalloc holding every block
// at a kDeviceAlignment-aligned stride.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "acl_runtime.h"
#include "block_allocator.h"

namespace paged::ascend {

// RAII owner of one aclrtMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer(int32_t device, size_t bytes);
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(ptr_.get()); }
  size_t bytes() const { return bytes_; }
  int32_t device() const { return device_; }

 private:
  struct AclFree {
    void operator()(void* p) const noexcept { AclRuntime::get().free(p); }
  };
  std::unique_ptr<void, AclFree> ptr_;
  size_t bytes_;
  int32_t device_;
};

// Stride of one block in the arena: block_bytes rounded up to kDeviceAlignment.
// Throws std::invalid_argument when block_bytes <= 0 or the arena would overflow.
size_t block_stride(int64_t num_blocks, int64_t block_bytes);

class NpuBlockPool : public BlockAllocator {
 public:
  explicit NpuBlockPool(int64_t num_blocks) : BlockAllocator(num_blocks) {}

  // Allocates the arena on `device` (once; a second call is an error).
  void reserve_device_memory(int64_t block_bytes, int32_t device);
  bool has_device_memory() const;
  size_t block_stride() const;
  size_t device_bytes() const;
  int32_t device() const;
  // Device address of a block's first byte; IndexError-style std::out_of_range for a bad id.
  uintptr_t block_address(int64_t block) const;

 private:
  const DeviceBuffer& arena() const;  // throws std::runtime_error when none reserved

  mutable std::mutex arena_mu_;
  std::unique_ptr<DeviceBuffer> arena_;
  size_t stride_ = 0;
};

}  // namespace paged::ascend
