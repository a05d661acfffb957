#include "attention/tensor_args.h"

#include <stdexcept>

namespace nb = nanobind;

namespace paged::cpu::attn {

int64_t positive(const char* name, int64_t v) {
  if (v <= 0) args::fail(name, "> 0", v);
  return v;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::FP8: return "float8_e4m3fn";
    default: return "int8";
  }
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string TensorArg::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

std::string expected_str(std::initializer_list<int64_t> shape) {
  std::string s = "[";
  size_t i = 0;
  for (int64_t d : shape) s += (i++ ? ", " : "") + (d < 0 ? std::string("*") : std::to_string(d));
  return s + "]";
}

}  // namespace

std::string dlpack_dtype_str(const nb::dlpack::dtype& t) {
  const char* kind = "dtype code " ;
  switch (nb::dlpack::dtype_code(t.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
    case nb::dlpack::dtype_code::Float8_E4M3FN: return "float8_e4m3fn";
    default: break;
  }
  return kind + std::to_string(int(t.bits));
}

namespace {

// Device, rank, shape and C-contiguity; fills everything but the dtype.
TensorArg common(const char* name, const Array& a, std::initializer_list<int64_t> shape, bool check_shape) {
  TensorArg t;
  t.name = name;
  if (a.device_type() != nb::device::cpu::value)
    args::fail(name, "a CPU tensor", "DLPack device type " + std::to_string(a.device_type()));
  for (size_t i = 0; i < a.ndim(); ++i) t.shape.push_back(int64_t(a.shape(i)));
  if (check_shape) {
    bool ok = a.ndim() == shape.size();
    size_t i = 0;
    for (int64_t d : shape) ok = ok && (d < 0 || (i < t.shape.size() && t.shape[i] == d)), ++i;
    if (!ok) args::fail(name, "shape " + expected_str(shape), "shape " + t.shape_str());
  }
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (t.shape[i] != 1 && int64_t(a.stride(i)) != expect)
      args::fail(name, "a contiguous tensor (stride " + std::to_string(expect) + " in dim " + std::to_string(i) + ")",
                 "shape " + t.shape_str() + " with stride " + std::to_string(a.stride(i)));
    expect *= t.shape[i];
  }
  t.data = const_cast<void*>(a.data());
  return t;
}

}  // namespace

TensorArg float_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape, DType* dtype) {
  TensorArg t = common(name, a, shape, true);
  const auto dt = a.dtype();
  if (dt == nb::dtype<float>()) *dtype = DType::F32;
  else if (dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 && dt.lanes == 1) *dtype = DType::BF16;
  else if (dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16 && dt.lanes == 1) *dtype = DType::F16;
  else args::fail(name, "dtype float32, bfloat16 or float16", "dtype " + dlpack_dtype_str(dt));
  t.elem_size = *dtype == DType::F32 ? 4 : 2;
  return t;
}

TensorArg cache_tensor(const char* name, const Array& a, std::initializer_list<int64_t> shape, DType* dtype) {
  const auto dt = a.dtype();
  if (dt.code == uint8_t(nb::dlpack::dtype_code::Int) && dt.bits == 8 && dt.lanes == 1) {
    TensorArg t = common(name, a, shape, true);
    *dtype = DType::I8;
    t.elem_size = 1;
    return t;
  }
  if (dt.code == uint8_t(nb::dlpack::dtype_code::Float8_E4M3FN) && dt.bits == 8 && dt.lanes == 1) {
    TensorArg t = common(name, a, shape, true);
    *dtype = DType::FP8;
    t.elem_size = 1;
    return t;
  }
  if (dt == nb::dtype<float>() || dt.bits == 16) return float_tensor(name, a, shape, dtype);
  args::fail(name, "dtype float32, bfloat16, float16, int8 or float8_e4m3fn", "dtype " + dlpack_dtype_str(dt));
}

TensorArg int_tensor(const char* name, const Array& a, int bits, std::initializer_list<int64_t> shape) {
  TensorArg t = common(name, a, shape, true);
  const auto dt = a.dtype();
  if (dt.code != uint8_t(nb::dlpack::dtype_code::Int) || dt.bits != bits || dt.lanes != 1)
    args::fail(name, "dtype int" + std::to_string(bits), "dtype " + dlpack_dtype_str(dt));
  t.elem_size = size_t(bits / 8);
  return t;
}

TensorArg any_tensor(const char* name, const Array& a) {
  TensorArg t = common(name, a, {}, false);
  t.elem_size = (size_t(a.dtype().bits) * a.dtype().lanes + 7) / 8;
  return t;
}

void require_same_shape(const TensorArg& a, const TensorArg& b) {
  if (a.shape != b.shape) args::fail(b.name, "the shape of " + a.name + " " + a.shape_str(), "shape " + b.shape_str());
}

void require_dim(const TensorArg& t, size_t i, int64_t want, const char* why) {
  if (t.shape[i] != want)
    args::fail(t.name, "dim " + std::to_string(i) + " = " + std::to_string(want) + " (" + why + ")",
               "shape " + t.shape_str());
}

}  // namespace paged::cpu::attn
