// The fused ops' row kernels (kernels.inc, one build per ISA: ops_scalar.cpp,
// arch/x86/ops/ops_avx2.cpp) and their arguments, checked by fused_ops.cpp
// before any kernel runs. Free of nanobind: the kernel table
// (kernel_builds.cpp) and the C++ drivers include it.
#pragma once

#include <cstdint>

namespace paged::cpu::ops {

enum class Elem { F32, BF16 };

// rms_norm / fused_add_rms_norm over rows of `width` elements.
struct NormArgs {
  void* out;             // [T, width]: normalised rows (x itself for the fused op)
  const void* in;        // [T, width]: rows to normalise (plain rms_norm)
  void* residual;        // [T, width]: fused op only, residual += x
  const void* weight;    // [width]
  Elem elem;
  int64_t width;
  float eps;
};

// silu_and_mul / gelu_tanh_and_mul: act(gate) * up.
struct SiluMulArgs {
  void* out;            // [T, inter]
  const void* gate_up;  // [T, 2 * inter]: gate then up
  Elem elem;
  int64_t inter;
};

struct RopeArgs {
  void* qkv;                // [T, (H + 2 Hkv) * D], q and k parts rotated in place
  const int64_t* positions; // [T], checked against the table
  const float* cos_sin;     // [max_pos, R]: cos(pos * f_i) for i < R/2, then sin
  Elem elem;
  int64_t rotated_heads;    // H + Hkv
  int64_t row_stride;       // (H + 2 Hkv) * D
  int64_t head_dim;         // D
  int64_t rotary_dim;       // R: the leading dims of each head that rotate (even, <= D); the rest pass
};

struct ArgmaxArgs {
  const float* logits;  // [T, width]
  int64_t* out;         // [T]
  int64_t width;        // >= 1, < 2^31
};

// Mixture-of-experts routing (core/models/moe.py route, from the rows
// themselves): per row, the router's logits, scores, top-k and weights.
struct RouteArgs {
  const float* x;       // [T, hidden]
  const float* router;  // [experts, hidden]
  float* weights;       // [T, top_k]: the chosen experts' scores, best first
  int64_t* ids;         // [T, top_k]: their ids
  int64_t hidden, experts, top_k;
  bool sigmoid;         // scores: each logit's sigmoid, else the softmax over the experts
  bool normalize;       // weights divided by their sum
};

// Per-ISA builds of the row kernels: each handles rows [begin, end).
struct RowKernels {
  const char* isa;
  void (*rms_norm)(const NormArgs&, int64_t begin, int64_t end);
  void (*add_rms_norm)(const NormArgs&, int64_t begin, int64_t end);
  void (*silu_and_mul)(const SiluMulArgs&, int64_t begin, int64_t end);
  void (*gelu_tanh_and_mul)(const SiluMulArgs&, int64_t begin, int64_t end);
  void (*rotary)(const RopeArgs&, int64_t begin, int64_t end);
  void (*argmax)(const ArgmaxArgs&, int64_t begin, int64_t end);
  void (*moe_route)(const RouteArgs&, int64_t begin, int64_t end);
};
namespace isa_avx2 { extern const RowKernels kKernels; }
namespace isa_scalar { extern const RowKernels kKernels; }

}  // namespace paged::cpu::ops
