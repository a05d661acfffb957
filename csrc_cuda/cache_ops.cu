// Cache writes and block moves. These are pure copies, so they move 16-byte
// vectors regardless of dtype (a head row is 64 or 128 elements: always a
// multiple of 16 bytes) and need no per-dtype instantiation.
#include "common.cuh"

namespace paged::cuda {
namespace {

constexpr int kCopyThreads = 128;

// One CTA per token: scatter its [num_kv_heads, head_size] key and value rows
// into slot `slot_mapping[t]`. Negative slots are padding; out-of-range slots
// are skipped (device-side guard: no stray writes; the Python wrapper rejects
// them up front in debug mode).
__global__ void reshape_and_cache_kernel(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                         uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
                                         const std::int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                         int block_size, int row_vecs, std::int64_t num_slots) {
  const int t = blockIdx.x;
  const std::int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= num_slots) return;
  const std::int64_t block = slot / block_size;
  const int offset = static_cast<int>(slot % block_size);
  for (int v = threadIdx.x; v < num_kv_heads * row_vecs; v += blockDim.x) {
    const int head = v / row_vecs, c = v % row_vecs;
    const std::int64_t src = (std::int64_t(t) * num_kv_heads + head) * row_vecs + c;
    const std::int64_t dst = ((block * num_kv_heads + head) * block_size + offset) * row_vecs + c;
    key_cache[dst] = key[src];
    value_cache[dst] = value[src];
  }
}

// grid (num_pairs, 2): y = 0 copies the key block, y = 1 the value block.
__global__ void copy_blocks_kernel(uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
                                   const std::int64_t* __restrict__ mapping, std::int64_t block_vecs,
                                   std::int64_t num_blocks) {
  const std::int64_t src = mapping[2 * blockIdx.x], dst = mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;  // device-side guard
  uint4* cache = blockIdx.y == 0 ? key_cache : value_cache;
  for (std::int64_t i = threadIdx.x; i < block_vecs; i += blockDim.x)
    cache[dst * block_vecs + i] = cache[src * block_vecs + i];
}

}  // namespace

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error: no driver / no device
    return 0;
  }
  return n;
}

int compute_capability(int device) noexcept {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

void reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                       const std::int64_t* slot_mapping, int num_tokens, const CacheGeometry& g,
                       std::uintptr_t stream) {
  if (num_tokens == 0) return;
  const int row_vecs = static_cast<int>(g.head_size * g.elem_bytes() / sizeof(uint4));
  reshape_and_cache_kernel<<<num_tokens, kCopyThreads, 0, as_stream(stream)>>>(
      static_cast<const uint4*>(key), static_cast<const uint4*>(value), static_cast<uint4*>(key_cache),
      static_cast<uint4*>(value_cache), slot_mapping, g.num_kv_heads, g.block_size, row_vecs,
      std::int64_t(g.num_blocks) * g.block_size);
  check_launch("reshape_and_cache");
}

void copy_blocks(void* key_cache, void* value_cache, const std::int64_t* block_mapping, int num_pairs,
                 const CacheGeometry& g, std::uintptr_t stream) {
  if (num_pairs == 0) return;
  const std::int64_t block_vecs = std::int64_t(g.block_bytes() / sizeof(uint4));
  copy_blocks_kernel<<<dim3(num_pairs, 2), kCopyThreads * 2, 0, as_stream(stream)>>>(
      static_cast<uint4*>(key_cache), static_cast<uint4*>(value_cache), block_mapping, block_vecs,
      g.num_blocks);
  check_launch("copy_blocks");
}

void swap_blocks(const void* src, void* dst, const std::int64_t* mapping, int num_pairs,
                 std::size_t block_bytes, std::uintptr_t stream) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (int i = 0; i < num_pairs; ++i)
    check_cuda(cudaMemcpyAsync(d + mapping[2 * i + 1] * block_bytes, s + mapping[2 * i] * block_bytes,
                               block_bytes, cudaMemcpyDefault, as_stream(stream)),
               "swap_blocks");
}

DeviceArena::DeviceArena(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
  // Allocate on `device` without changing the caller's current device (torch tracks it).
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), "DeviceArena");
  check_cuda(cudaSetDevice(device), "DeviceArena");
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("DeviceArena: cudaMalloc of " + std::to_string(bytes) + " bytes on cuda:" +
                             std::to_string(device) + " failed: " + cudaGetErrorString(err));
  }
  mem_.reset(p);
}

void DeviceArena::Free::operator()(void* p) const noexcept { cudaFree(p); }

}  // namespace paged::cuda
