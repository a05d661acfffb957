// Shared device helpers: launch checks, element conversions, dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops.h"

namespace paged::cuda {

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Throws with the op name and CUDA's own error string.
inline void check_cuda(cudaError_t err, const char* op) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(op) + ": CUDA error: " + cudaGetErrorString(err));
}
// After a kernel launch: a bad configuration or a sticky error from an
// earlier kernel surfaces here, with the name of the op that noticed it.
inline void check_launch(const char* op) { check_cuda(cudaGetLastError(), op); }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

// Calls fn(T{}) with the element type named by `dt`.
template <typename Fn>
void dispatch_dtype(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::F32: fn(float{}); break;
    case DType::F16: fn(__half{}); break;
    case DType::BF16: fn(__nv_bfloat16{}); break;
  }
}

// First key visible from position `pos` (keys j with pos - window < j <= pos).
__device__ inline int first_visible_key(int pos, int window) { return window > 0 ? max(0, pos - window + 1) : 0; }

// 16-byte vector `c` of one key's row (kv head `kvh`, `row_vecs` vectors a
// row) in the key and value caches, read through the sequence's block
// `table`; zeros for keys at or past `key_end`, past the table, or in a stray
// block (the device-side guard: never an out-of-bounds read).
struct KvVectors {
  uint4 k, v;
};
__device__ __forceinline__ KvVectors load_kv_vectors(const AttentionArgs& a, const int* table, int kvh, int key,
                                                     int key_end, int c, int row_vecs, int num_kv_heads,
                                                     int block_size, int num_blocks) {
  KvVectors out{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (key >= key_end || key / block_size >= a.max_blocks_per_seq) return out;
  const int block = table[key / block_size];
  if (block < 0 || block >= num_blocks) return out;
  const std::int64_t off = ((std::int64_t(block) * num_kv_heads + kvh) * block_size + key % block_size) * row_vecs + c;
  out.k = static_cast<const uint4*>(a.key_cache)[off];
  out.v = static_cast<const uint4*>(a.value_cache)[off];
  return out;
}

// Prefill attention in float16 / bfloat16 on tensor cores (prefill_tc.cu);
// `a.query_start_loc` is set, arguments validated by bindings.cpp.
void prefill_tensor_core(const AttentionArgs& a, const CacheGeometry& g, cudaStream_t stream);

// Calls fn(std::integral_constant<int, D>{}) for the head size `d`, one of
// kHeadSizes (bindings.cpp has checked it): the only instantiations.
template <typename Fn>
void dispatch_head_size(int d, Fn&& fn) {
  switch (d) {
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 80: fn(std::integral_constant<int, 80>{}); break;
    case 96: fn(std::integral_constant<int, 96>{}); break;
    case 112: fn(std::integral_constant<int, 112>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    case 256: fn(std::integral_constant<int, 256>{}); break;
    default: throw std::invalid_argument("head_size: expected one of kHeadSizes, got " + std::to_string(d));
  }
}

// Kernels whose shared memory is sized at launch: above the 48 KiB default a
// kernel must opt in (per device; cheap, so done at every launch, which also
// works under CUDA graph capture).
template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes, const char* op) {
  if (bytes > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), op);
}

}  // namespace paged::cuda
