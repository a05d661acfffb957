#include "npu_block_pool.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace paged::ascend {

DeviceBuffer::DeviceBuffer(int32_t device, size_t bytes) : bytes_(bytes), device_(device) {
  const AclRuntime& acl = AclRuntime::get();
  acl.set_device(device);
  ptr_.reset(acl.malloc(bytes));
}

size_t block_stride(int64_t num_blocks, int64_t block_bytes) {
  if (num_blocks <= 0)
    throw std::invalid_argument("num_blocks must be > 0, got " + std::to_string(num_blocks));
  if (block_bytes <= 0)
    throw std::invalid_argument("block_bytes must be > 0, got " + std::to_string(block_bytes));
  const auto bytes = static_cast<uint64_t>(block_bytes);
  const uint64_t limit = std::numeric_limits<size_t>::max() / 2;
  if (bytes > limit - kDeviceAlignment || (bytes + kDeviceAlignment) > limit / static_cast<uint64_t>(num_blocks))
    throw std::invalid_argument("block_bytes " + std::to_string(block_bytes) + " x " + std::to_string(num_blocks) +
                                " blocks overflows the device arena size");
  return static_cast<size_t>((bytes + kDeviceAlignment - 1) / kDeviceAlignment * kDeviceAlignment);
}

void NpuBlockPool::reserve_device_memory(int64_t block_bytes, int32_t device) {
  if (device < 0) throw std::invalid_argument("device must be >= 0, got " + std::to_string(device));
  const size_t stride = ascend::block_stride(num_blocks(), block_bytes);
  std::lock_guard<std::mutex> lock(arena_mu_);
  if (arena_)
    throw std::runtime_error("device memory already reserved (" + std::to_string(arena_->bytes()) +
                             " bytes on device " + std::to_string(arena_->device()) + ")");
  arena_ = std::make_unique<DeviceBuffer>(device, stride * static_cast<size_t>(num_blocks()));
  stride_ = stride;
}

const DeviceBuffer& NpuBlockPool::arena() const {
  if (!arena_) throw std::runtime_error("no device memory reserved: call reserve_device_memory first");
  return *arena_;
}

bool NpuBlockPool::has_device_memory() const {
  std::lock_guard<std::mutex> lock(arena_mu_);
  return arena_ != nullptr;
}

size_t NpuBlockPool::block_stride() const {
  std::lock_guard<std::mutex> lock(arena_mu_);
  arena();
  return stride_;
}

size_t NpuBlockPool::device_bytes() const {
  std::lock_guard<std::mutex> lock(arena_mu_);
  return arena().bytes();
}

int32_t NpuBlockPool::device() const {
  std::lock_guard<std::mutex> lock(arena_mu_);
  return arena().device();
}

uintptr_t NpuBlockPool::block_address(int64_t block) const {
  if (block < 0 || block >= num_blocks())
    throw std::out_of_range("block " + std::to_string(block) + " is not a block id in [0, " +
                            std::to_string(num_blocks()) + ")");
  std::lock_guard<std::mutex> lock(arena_mu_);
  return arena().address() + static_cast<uintptr_t>(block) * stride_;
}

}  // namespace paged::ascend
