// Plain-data arguments of the CPU attention kernels and the per-ISA entry
// points. Everything here is validated once at the Python boundary
// (bindings.cpp); the kernels trust it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "runtime/parallel.h"

namespace paged::cpu::attn {

// I8 and FP8 (float8_e4m3fn) are KV cache dtypes only (queries and outputs
// are floating): each cache row is head_size one-byte codes followed by that
// row's float32 scale, so a row (one token of one kv head) dequantizes as
// value(code[d]) * scale (kI8ScaleBytes; value = the int8, or the e4m3fn
// number the byte encodes).
enum class DType { F32, BF16, F16, I8, FP8 };
constexpr int64_t kI8ScaleBytes = 4;

// Rows of one-byte codes and a trailing float32 scale (int8, fp8_e4m3).
inline bool scaled_rows(DType t) { return t == DType::I8 || t == DType::FP8; }

// Bytes of one cache row (one token of one kv head) of head size D.
inline int64_t cache_row_bytes(DType t, int64_t D) {
  return t == DType::F32 ? 4 * D : scaled_rows(t) ? D + kI8ScaleBytes : 2 * D;
}

// One attention call: decode is the special case "one query row per sequence".
struct AttnArgs {
  void* out;            // [T, H, D], dtype
  const void* query;    // [T, H, D], dtype
  const void* key_cache;    // [NB, Hkv, BS, row], cache_dtype (row: cache_row_bytes)
  const void* value_cache;  // same
  DType dtype;              // query and out
  DType cache_dtype;        // key_cache and value_cache (any; I8 = quantized rows)
  int64_t num_heads, num_kv_heads, head_size, block_size;
  const int32_t* block_tables;  // [S, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;        // [S]
  const int32_t* query_start_loc; // [S + 1]
  int64_t num_seqs;
  float scale;
  int64_t sliding_window;  // 0 = unlimited
};

// Fixed work-splitting constants. They depend on nothing but the sequence
// itself, which is what makes results independent of batch and thread count.
constexpr int64_t kKeysPerSplit = 256;   // keys handled by one work item
constexpr int64_t kQueryVectorsPerTile = 32;  // query rows x heads per item (prefill)

// --- scalar conversions (RNE, like torch) used for query/output and the scalar path
inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (!man) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400u));
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // subnormal half (or zero): fixed-point round to 2^-24
    float m = std::fabs(f) * 16777216.0f;  // exact scaling by 2^24
    return uint16_t(sign | uint32_t(std::nearbyint(m)));
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

inline float load_scalar(const void* p, int64_t i, DType t) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}
inline void store_scalar(void* p, int64_t i, DType t, float v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = v; break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
  }
}

// --- float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, 0x7f / 0xff are NaN, the largest finite value is 448, the
// smallest subnormal 2^-9. float -> e4m3fn rounds to nearest even like
// torch's x.to(torch.float8_e4m3fn); it saturates (|x| >= 448 -> +-448) where
// torch would give NaN for |x| >= 464, which the quantization never passes
// (it clamps to +-448 first).
constexpr float kFp8Max = 448.0f;
inline uint8_t float_to_e4m3fn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7fu);  // NaN
  if (a >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448: saturate
  if (a < 0x3c800000u) {  // below 2^-6: subnormal (or zero), a multiple of 2^-9
    const float m = std::fabs(f) * 512.0f;  // exact scaling by 2^9
    return uint8_t(sign | uint32_t(std::nearbyint(m)));  // 8 = 2^-6 encodes as the smallest normal
  }
  uint32_t r = a - 0x3c000000u;  // rebias exponent 127 -> 7
  r += 0x7ffffu + ((r >> 20) & 1u);  // round the 20 dropped mantissa bits to nearest even
  return uint8_t(sign | (r >> 20));
}

// The 256 values of e4m3fn, built once from the definition: every ISA build's
// loader reads its codes through this table (exact: each is a float32).
struct Fp8Table {
  alignas(64) float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xf, m = c & 7;
      float x = e ? std::ldexp(float(8 + m), e - 10) : std::ldexp(float(m), -9);
      if ((c & 0x7f) == 0x7f) x = std::numeric_limits<float>::quiet_NaN();
      v[c] = (c & 0x80) ? -x : x;
    }
  }
};
inline const float* e4m3fn_table() {
  static const Fp8Table table;
  return table.v;
}
inline float e4m3fn_to_float(uint8_t c) { return e4m3fn_table()[c]; }

// The quantization of one cache row (the reference backend implements the
// same in torch, bitwise: backends/reference/kv_quant.py): per (token, kv
// head), symmetric, scale = max|x| / qmax with qmax = 127 (int8) or 448
// (fp8_e4m3); int8 codes = round-half-even(x / scale) in [-127, 127], fp8
// codes = e4m3fn(clamp(x / scale, -448, 448)); a zero row gets scale 0 and
// codes 0. Depends on nothing but the row itself, so a block's contents never
// depend on how its tokens were chunked.
inline float quantize_scale(const float* x, int64_t D, float qmax, void* row) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / qmax;
  std::memcpy(static_cast<char*>(row) + D, &scale, sizeof scale);
  return scale;
}
inline void quantize_row_i8(const float* x, int64_t D, int8_t* row) {
  const float scale = quantize_scale(x, D, 127.0f, row);
  for (int64_t d = 0; d < D; ++d) {
    const float r = scale > 0.0f ? std::nearbyint(x[d] / scale) : 0.0f;
    row[d] = int8_t(std::min(127.0f, std::max(-127.0f, r)));
  }
}
inline void quantize_row_fp8(const float* x, int64_t D, uint8_t* row) {
  const float scale = quantize_scale(x, D, kFp8Max, row);
  for (int64_t d = 0; d < D; ++d)
    row[d] = scale > 0.0f ? float_to_e4m3fn(std::min(kFp8Max, std::max(-kFp8Max, x[d] / scale))) : 0;
}
inline float row_scale(const void* row, int64_t D) {
  float s;
  std::memcpy(&s, static_cast<const char*>(row) + D, sizeof s);
  return s;
}

// Per-ISA implementations, each kernel_impl.inc over its Vec: scalar here
// (attention_scalar.cpp), x86-64's in arch/x86/attention, aarch64's in
// arch/arm/attention; kernel_builds.cpp lists them with what each needs.
#define PAGED_DECLARE_ISA(ns) \
  namespace ns {              \
  void attention(const AttnArgs& a); \
  }
PAGED_DECLARE_ISA(isa_scalar)
PAGED_DECLARE_ISA(isa_avx2)
PAGED_DECLARE_ISA(isa_avx512)
PAGED_DECLARE_ISA(isa_neon)
#undef PAGED_DECLARE_ISA

// float32 values into a float16 cache row, float_to_f16 per element: the
// scalar definition (attention_scalar.cpp) and F16C's, the same IEEE
// rounding 8 values at a time (arch/x86/attention/f16_row_f16c.cpp).
using F16RowKernel = void (*)(const float* src, uint16_t* dst, int64_t n);
namespace isa_scalar {
void f32_to_f16_row(const float* src, uint16_t* dst, int64_t n);
}
namespace isa_avx2 {
void f32_to_f16_row(const float* src, uint16_t* dst, int64_t n);
}

// The build chosen at run time (dispatch.cpp).
void run_attention(const AttnArgs& a);

}  // namespace paged::cpu::attn
