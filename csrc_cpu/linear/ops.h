// Python-facing entry points of the quantized linear (bound in bindings.cpp).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>

#include "attention/tensor_args.h"
#include "linear/quant_linear.h"

namespace paged::cpu::linear {

using Array = nanobind::ndarray<>;

// out[M, N] = x[M, K] @ W^T with W [N, K] given as GGUF blocks (qs, d, m);
// activations "float32" (x as given), "int8" (x quantized per 32-block, int8.h) or
// "int8x2" (two int8 terms). two_term_rows (int8x2 only; -1 = all): only rows
// [0, two_term_rows) get the second term, the rest are computed as "int8" would
// (each row bitwise what a call of that row alone with that setting returns).
// panels: the weight's persistent panels (weight_panels.h) for the int8 paths
// (same bits, no per-call panel build); ignored with "float32". prompt_rows
// (int8x2 only): what the rows from two_term_rows on are, "int8" (one int8
// term) or "bf16" (bfloat16 on AMX tiles, bf16_prompt.h; ValueError where
// bf16_prompt_supported() is false).
void quant_linear(const Array& x, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m, const Array& out, const std::string& activations = "float32",
                  int64_t two_term_rows = -1, const std::optional<Array>& panels = std::nullopt,
                  const std::string& prompt_rows = "int8");
// "float32", "uint8", "bfloat16", ... for error messages.
std::string dtype_name(const nanobind::dlpack::dtype& t);
// A contiguous CPU tensor of dtype `want` and the given rank, else ValueError
// "<name>: expected dtype <want>, got ..." / "expected a <rank>-D tensor".
attn::TensorArg tensor_of(const char* name, const Array& a, nanobind::dlpack::dtype want, size_t rank);
// The packed weight: qs, d, m checked against each other; fills a's qtype, N, K and pointers.
void check_weight(LinearArgs& a, const std::string& qtype, const Array& qs, const Array& d,
                  const std::optional<Array>& m);
// a's checked weight read from its persistent panels (checked against it
// and the active build, ValueError otherwise): its packed arrays may be
// stand-ins of their shape (a matrix that keeps only its panels), never read.
void use_panels(LinearArgs& a, const Array& panels);
// The int8 / int8x2 paths (s16 too) on checked arguments (check_weight's
// weight, a.M, a.x, a.out set, panels where use_panels gave them), as
// quant_linear runs them with two_rows two-term rows (0: int8); no Python API, so a C++ caller may
// run several in its own parallel region (model/moe_experts.h), the nested
// loops then serial on each thread: same bits on any thread count.
void int8_linear_checked(LinearArgs& a, int64_t two_rows);
// out[N, K] = W, exactly as gguf dequantizes it.
void quant_dequantize(const std::string& qtype, const Array& qs, const Array& d, const std::optional<Array>& m,
                      const Array& out);

// out = int8 codes [N, K] packed as `qtype`: s16's ("s16.u5", ...; s16.h,
// "Packed codes"), uint8 [N, K/256 * 32 * bits], or q8_0's ("q8_0.s5";
// q8_packed.h), uint8 [N, K/32 * 20]; ValueError for a code the form cannot hold.
void pack_codes(const Array& codes, const std::string& qtype, const Array& out);

// out[M, N] = x[M, K] @ W^T with W [N, K] float16 or bfloat16, float32 sums
// in a fixed order per output (half.h): batch invariant, every build.
void half_linear(const Array& x, const Array& w, const Array& out);

// bfloat16 prompt rows (bf16_prompt.h).
bool bf16_prompt_supported();
// out (bfloat16, bf16_weight_elems(N, K) elements) = w16 [N, K] (bfloat16) in the tile layout.
void build_bf16_weight(const Array& w16, const Array& out);
// out[M, N] = x[M, K] @ W^T as above, W given by its tile-layout copy.
void bf16_linear(const Array& x, const Array& weight, const Array& out);

}  // namespace paged::cpu::linear
