// Checks of tensors arriving from Python (nanobind ndarray / DLPack), done once
// per call at the boundary. Failures throw std::invalid_argument (-> ValueError)
// or std::out_of_range (-> IndexError); messages have the one shape of
// csrc_shared/arg_error.h: "<name>: expected <X>, got <Y>".
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "arg_error.h"
#include "attention/kernel_common.h"

namespace paged::cpu::attn {

using Array = nanobind::ndarray<>;

// A CPU, C-contiguous tensor that passed its checks.
struct TensorArg {
  std::string name;
  void* data = nullptr;
  std::vector<int64_t> shape;
  size_t elem_size = 0;
  int64_t dim(size_t i) const { return shape[i]; }
  int64_t numel() const;
  std::string shape_str() const;
};

// Floating tensor (float32 / bfloat16 / float16) of the given rank; `shape`
// entries < 0 are free. `dtype` receives its dtype.
TensorArg float_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape, DType* dtype);
// A KV cache tensor of the given rank: float32 / bfloat16 / float16, or int8
// / float8_e4m3fn (DType::I8 / FP8: rows of head_size codes plus their
// scale, kernel_common.h).
TensorArg cache_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape, DType* dtype);
// Integer tensor of exactly `bits` width (int32 / int64).
TensorArg int_tensor(const char* name, const Array& a, int bits, std::initializer_list<int64_t> shape);
// Any dtype: used where only bytes are moved (block copies between caches).
TensorArg any_tensor(const char* name, const Array& a);

// ValueError / IndexError "<name>: expected <want>, got <got>" (arg_error.h).
using args::fail;
using args::fail_index;
// v itself when v > 0, else ValueError "<name>: expected > 0, got <v>".
int64_t positive(const char* name, int64_t v);
void require_same_shape(const TensorArg& a, const TensorArg& b);
void require_dim(const TensorArg& t, size_t i, int64_t want, const char* why);
const char* dtype_name(DType t);
// A DLPack dtype as "float32", "int8", "bfloat16", ...
std::string dlpack_dtype_str(const nanobind::dlpack::dtype& t);

}  // namespace paged::cpu::attn
