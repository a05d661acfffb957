// KV cache writes, reads and block copies; arguments are checked once up
// front. Block copies only move bytes, so one implementation serves every
// dtype; writes and reads convert when the tokens' dtype is not the cache's
// (an int8 or fp8_e4m3 cache quantizes on write and dequantizes on read:
// kernel_common.h).
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include <nanobind/nanobind.h>

#include "attention/ops.h"
#include "kernel_builds.h"

namespace nb = nanobind;

namespace paged::cpu::attn {
namespace {

struct CachePair {
  TensorArg key, value;
  DType dtype;
  int64_t num_blocks, num_kv_heads, block_size, head_size;
  int64_t num_slots() const { return num_blocks * block_size; }
};

CachePair check_caches(Array& key_cache, Array& value_cache) {
  CachePair c;
  DType vd;
  c.key = cache_tensor("key_cache", key_cache, {-1, -1, -1, -1}, &c.dtype);
  c.value = cache_tensor("value_cache", value_cache, {-1, -1, -1, -1}, &vd);
  require_same_shape(c.key, c.value);
  if (vd != c.dtype)
    fail("value_cache", std::string("the dtype of key_cache (") + dtype_name(c.dtype) + ")",
         std::string("dtype ") + dtype_name(vd));
  c.num_blocks = c.key.dim(0);
  c.num_kv_heads = c.key.dim(1);
  c.block_size = c.key.dim(2);
  c.head_size = c.key.dim(3) - (scaled_rows(c.dtype) ? kI8ScaleBytes : 0);
  if (c.head_size < 1)
    fail("key_cache", "dim 3 >= 1 (>= 5 for int8 / fp8_e4m3: the values plus a 4-byte scale)", c.key.shape_str());
  return c;
}

// slot_mapping: int64 [T]; every slot < num_slots (negative = padding).
const int64_t* check_slots(Array& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  TensorArg s = int_tensor("slot_mapping", slot_mapping, 64, {num_tokens});
  const auto* slots = static_cast<const int64_t*>(s.data);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_slots)
      fail_index("slot_mapping[" + std::to_string(t) + "]",
                 "a slot < " + std::to_string(num_slots) + " (the cache's size) or < 0 (padding)", slots[t]);
  return slots;
}

// Tokens [T, Hkv, D] of any floating dtype (converted to the cache's).
struct Tokens {
  TensorArg t;
  DType dtype;
};
Tokens check_tokens(const char* name, Array& a, const CachePair& c, int64_t num_tokens) {
  Tokens k;
  k.t = float_tensor(name, a, {num_tokens, c.num_kv_heads, c.head_size}, &k.dtype);
  return k;
}

// float32 values into a float16 / bfloat16 row in one pass (the decode step
// writes 2 x Hkv such rows per token and layer; per element through
// load_scalar and store_scalar it showed in decode profiles).
bool store_f32_row(const float* src, DType dt, void* dst, int64_t n) {
  if (dt == DType::F16) {
    static const F16RowKernel f16_row = f16_cache_row();  // the detector's answer is fixed at import
    f16_row(src, static_cast<uint16_t*>(dst), n);
    return true;
  }
  if (dt == DType::BF16) {
    for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = float_to_bf16(src[i]);
    return true;
  }
  return false;
}

// Copy one token's [Hkv, D] rows between a [T, Hkv, D] tensor and a cache
// slot: bytes when the dtypes agree, else converted through float32.
enum class Dir { ToCache, FromCache };
void move_token(const CachePair& c, const Tokens& tokens, void* cache, int64_t t, int64_t slot, Dir dir) {
  const int64_t D = c.head_size, row = cache_row_bytes(c.dtype, D);
  const size_t tbytes = size_t(D) * tokens.t.elem_size;
  const int64_t block = slot / c.block_size, off = slot % c.block_size;
  thread_local std::vector<float> buf;
  buf.resize(size_t(D));
  for (int64_t h = 0; h < c.num_kv_heads; ++h) {
    char* cache_row = static_cast<char*>(cache) + ((block * c.num_kv_heads + h) * c.block_size + off) * row;
    char* token_row = static_cast<char*>(tokens.t.data) + (t * c.num_kv_heads + h) * int64_t(tbytes);
    if (tokens.dtype == c.dtype) {
      if (dir == Dir::ToCache) std::memcpy(cache_row, token_row, tbytes);
      else std::memcpy(token_row, cache_row, tbytes);
    } else if (dir == Dir::ToCache) {
      if (tokens.dtype == DType::F32 && store_f32_row(reinterpret_cast<const float*>(token_row), c.dtype, cache_row, D))
        continue;
      for (int64_t d = 0; d < D; ++d) buf[size_t(d)] = load_scalar(token_row, d, tokens.dtype);
      if (c.dtype == DType::I8) quantize_row_i8(buf.data(), D, reinterpret_cast<int8_t*>(cache_row));
      else if (c.dtype == DType::FP8) quantize_row_fp8(buf.data(), D, reinterpret_cast<uint8_t*>(cache_row));
      else for (int64_t d = 0; d < D; ++d) store_scalar(cache_row, d, c.dtype, buf[size_t(d)]);
    } else if (c.dtype == DType::I8) {
      const auto* q = reinterpret_cast<const int8_t*>(cache_row);
      const float s = row_scale(q, D);
      for (int64_t d = 0; d < D; ++d) store_scalar(token_row, d, tokens.dtype, float(q[d]) * s);
    } else if (c.dtype == DType::FP8) {
      const auto* q = reinterpret_cast<const uint8_t*>(cache_row);
      const float s = row_scale(q, D);
      for (int64_t d = 0; d < D; ++d) store_scalar(token_row, d, tokens.dtype, e4m3fn_to_float(q[d]) * s);
    } else {
      for (int64_t d = 0; d < D; ++d) store_scalar(token_row, d, tokens.dtype, load_scalar(cache_row, d, c.dtype));
    }
  }
}

// block_mapping int64 [N, 2] of (src, dst) ids; destinations distinct.
const int64_t* check_mapping(Array& block_mapping, int64_t num_src, int64_t num_dst, int64_t* count) {
  TensorArg m = int_tensor("block_mapping", block_mapping, 64, {-1, 2});
  const auto* pairs = static_cast<const int64_t*>(m.data);
  *count = m.dim(0);
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < *count; ++i) {
    for (int col = 0; col < 2; ++col) {
      const int64_t id = pairs[2 * i + col], n = col ? num_dst : num_src;
      if (id < 0 || id >= n)
        fail_index("block_mapping[" + std::to_string(i) + ", " + std::to_string(col) + "]",
                   std::string("a ") + (col ? "destination" : "source") + " block id in [0, " + std::to_string(n) + ")",
                   id);
    }
    if (!seen.insert(pairs[2 * i + 1]).second)
      fail("block_mapping", "distinct destination blocks",
           "block " + std::to_string(pairs[2 * i + 1]) + " written more than once");
  }
  return pairs;
}

}  // namespace

void reshape_and_cache(Array key, Array value, Array key_cache, Array value_cache, Array slot_mapping) {
  CachePair c = check_caches(key_cache, value_cache);
  Tokens k = check_tokens("key", key, c, -1);
  const int64_t num_tokens = k.t.dim(0);
  Tokens v = check_tokens("value", value, c, num_tokens);
  const int64_t* slots = check_slots(slot_mapping, num_tokens, c.num_slots());
  nb::gil_scoped_release release;
#pragma omp parallel for if (num_tokens > 256)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    move_token(c, k, c.key.data, t, slots[t], Dir::ToCache);
    move_token(c, v, c.value.data, t, slots[t], Dir::ToCache);
  }
}

void read_kv(Array key_cache, Array value_cache, Array slot_mapping, Array key_out, Array value_out) {
  CachePair c = check_caches(key_cache, value_cache);
  Tokens k = check_tokens("key_out", key_out, c, -1);
  const int64_t num_tokens = k.t.dim(0);
  Tokens v = check_tokens("value_out", value_out, c, num_tokens);
  if (v.dtype != k.dtype)
    fail("value_out", std::string("the dtype of key_out (") + dtype_name(k.dtype) + ")",
         std::string("dtype ") + dtype_name(v.dtype));
  const int64_t* slots = check_slots(slot_mapping, num_tokens, c.num_slots());
  nb::gil_scoped_release release;
  const size_t token_bytes = size_t(c.num_kv_heads * c.head_size) * k.t.elem_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) {  // padding reads as zeros
      std::memset(static_cast<char*>(k.t.data) + t * token_bytes, 0, token_bytes);
      std::memset(static_cast<char*>(v.t.data) + t * token_bytes, 0, token_bytes);
      continue;
    }
    move_token(c, k, c.key.data, t, slots[t], Dir::FromCache);
    move_token(c, v, c.value.data, t, slots[t], Dir::FromCache);
  }
}

void copy_blocks(const std::vector<Array>& key_caches, const std::vector<Array>& value_caches, Array block_mapping) {
  if (key_caches.size() != value_caches.size())
    fail("value_caches", "one per layer of key_caches (" + std::to_string(key_caches.size()) + ")",
         value_caches.size());
  std::vector<void*> caches;
  TensorArg first;
  for (size_t l = 0; l < key_caches.size(); ++l) {
    CachePair c = check_caches(const_cast<Array&>(key_caches[l]), const_cast<Array&>(value_caches[l]));
    if (l == 0) first = c.key;
    else if (c.key.shape != first.shape || c.key.elem_size != first.elem_size)
      fail("key_caches[" + std::to_string(l) + "]",
           "the shape " + first.shape_str() + " and element size " + std::to_string(first.elem_size) +
               " of key_caches[0]",
           "shape " + c.key.shape_str() + ", element size " + std::to_string(c.key.elem_size) +
               " (all layers share one cache shape and dtype)");
    caches.push_back(c.key.data);
    caches.push_back(c.value.data);
  }
  if (caches.empty()) return;
  int64_t count = 0;
  const int64_t* pairs = check_mapping(block_mapping, first.dim(0), first.dim(0), &count);
  const size_t block_bytes = size_t(first.numel() / first.dim(0)) * first.elem_size;
  const int64_t jobs = int64_t(caches.size()) * count;
  nb::gil_scoped_release release;
#pragma omp parallel for if (jobs > 16)
  for (int64_t j = 0; j < jobs; ++j) {
    char* base = static_cast<char*>(caches[size_t(j / count)]);
    const int64_t* p = pairs + 2 * (j % count);
    std::memcpy(base + p[1] * block_bytes, base + p[0] * block_bytes, block_bytes);
  }
}

void to_fp8_e4m3fn(Array x, Array out) {
  DType xd, od;
  TensorArg xs = float_tensor("x", x, {-1}, &xd);
  TensorArg os = cache_tensor("out", out, {xs.dim(0)}, &od);
  if (xd != DType::F32) fail("x", "dtype float32", std::string("dtype ") + dtype_name(xd));
  if (od != DType::FP8) fail("out", "dtype float8_e4m3fn", std::string("dtype ") + dtype_name(od));
  const auto* src = static_cast<const float*>(xs.data);
  auto* dst = static_cast<uint8_t*>(os.data);
  for (int64_t i = 0; i < xs.dim(0); ++i) dst[i] = float_to_e4m3fn(src[i]);
}

void swap_blocks(Array src_cache, Array dst_cache, Array block_mapping) {
  TensorArg src = any_tensor("src_cache", src_cache), dst = any_tensor("dst_cache", dst_cache);
  if (src.shape.empty()) fail("src_cache", "a leading block dimension", "a scalar");
  if (src_cache.dtype() != dst_cache.dtype())
    fail("dst_cache", "the dtype of src_cache (" + dlpack_dtype_str(src_cache.dtype()) + ")",
         "dtype " + dlpack_dtype_str(dst_cache.dtype()) + " (block copies move raw bytes)");
  if (dst.shape.size() != src.shape.size() || !std::equal(src.shape.begin() + 1, src.shape.end(), dst.shape.begin() + 1))
    fail("dst_cache", "the shape of src_cache " + src.shape_str() + " in every dim but the first",
         "shape " + dst.shape_str());
  int64_t count = 0;
  const int64_t* pairs = check_mapping(block_mapping, src.dim(0), dst.dim(0), &count);
  const size_t block_bytes = src.dim(0) ? size_t(src.numel() / src.dim(0)) * src.elem_size : 0;
  nb::gil_scoped_release release;
#pragma omp parallel for if (count > 16)
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(static_cast<char*>(dst.data) + pairs[2 * i + 1] * block_bytes,
                static_cast<const char*>(src.data) + pairs[2 * i] * block_bytes, block_bytes);
}

}  // namespace paged::cpu::attn
