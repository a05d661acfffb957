// Alignment the CUDA kernels need of their tensors, as plain host C++ (no
// CUDA, no nanobind) so that bindings.cpp checks it before any launch and a
// g++ test driver checks the rule itself (tests/test_cuda_alignment.py).
//
// Every kernel moves rows as 16-byte vectors (uint4): the cache writes and
// copies, the decode kernel's K/V tiles, the tensor-core prefill's Q/K/V
// tiles. A vector load from an address that is not a multiple of 16 is a
// misaligned-address fault, which poisons the CUDA context (every later call
// in the process fails). torch hands out allocations aligned far beyond 16
// bytes, but a view can start anywhere: `flat[1:].view(n, h, d)` is
// contiguous and 2 bytes off. So each array's data pointer is checked here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace paged::cuda {

// Bytes of the vectors the kernels load and store.
constexpr std::size_t kVectorBytes = 16;

// How far `data` lies past the previous multiple of `align` (0 = aligned).
inline std::size_t misalignment(const void* data, std::size_t align) noexcept {
  return align ? static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(data) % align) : 0;
}

// The alignment an array needs: 16 bytes for rows the kernels read or write
// as vectors (floating-point tensors), the element's own size otherwise
// (index tensors, read element by element).
constexpr std::size_t required_alignment(bool vector_rows, std::size_t elem_bytes) noexcept {
  return vector_rows ? kVectorBytes : elem_bytes;
}

// The "expected ..." and "got ..." halves of the error for a misaligned array
// (bindings.cpp raises them as a ValueError with the array's name).
inline std::string alignment_expected(std::size_t align) {
  return "a data pointer aligned to " + std::to_string(align) + " bytes (the kernels read " +
         (align == kVectorBytes ? "16-byte vectors" : "whole elements") + ")";
}
inline std::string alignment_got(std::size_t off) {
  return "an address " + std::to_string(off) + " bytes past one (a view at an odd offset: pass a copy)";
}

}  // namespace paged::cuda
