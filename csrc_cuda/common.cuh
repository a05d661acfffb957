// Shared device helpers: launch checks, element conversions, dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

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

}  // namespace paged::cuda
