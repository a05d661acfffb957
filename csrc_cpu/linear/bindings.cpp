// paged._C_cpu quantized linear ops (contract: docs/kernels.md, "Quantized linear (CPU)").
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "linear/bf16_prompt.h"
#include "linear/int8.h"
#include "linear/ops.h"
#include "linear/s16.h"
#include "linear/weight_panels.h"
#include "module.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace paged::cpu {
void register_linear(nb::module_& m) {
  namespace l = linear;
  m.def("quant_linear", &l::quant_linear, "x"_a, "qtype"_a, "qs"_a, "d"_a, "m"_a.none(), "out"_a,
        "activations"_a = "float32", "two_term_rows"_a = -1, "panels"_a.none() = nb::none(),
        "prompt_rows"_a = "int8",
        "out[M, N] = x[M, K] @ W^T, W [N, K] packed as GGUF q4_0 / q4_1 / q8_0 blocks or s16 (int8 codes, a scale and "
        "optional offset per 16 weights; int8 paths only). activations='float32': "
        "calls of M <= 2 rows quantize x to two-term int16 per 32-block, more rows compute in fp32; "
        "activations='int8': x quantized to int8 per 32-block, integer dot products, bitwise the same for a "
        "row whatever the call; 'int8x2': a second int8 term (the residual), for rows [0, two_term_rows) only "
        "when two_term_rows >= 0 (the rest as 'int8'). panels: build_weight_panels' tensor for this weight and linear "
        "ISA (int8 paths; same bits, without the per-call panel build). prompt_rows: with int8x2 and "
        "two_term_rows >= 0, what the rows from there on are: 'int8' (one term) or 'bf16' (bfloat16 on AMX-BF16 "
        "tiles made from the weight's int8 panels, bf16_prompt_supported() CPUs) (docs/kernels.md).");
  m.def("quant_dequantize", &l::quant_dequantize, "qtype"_a, "qs"_a, "d"_a, "m"_a.none(), "out"_a,
        "out[N, K] = the dense float32 weight of the packed blocks.");
  m.def("pack_codes", &l::pack_codes, "codes"_a, "qtype"_a, "out"_a,
        "out = int8 codes [N, K] packed as qtype, the form quant_linear reads: s16's (K a multiple of 256; "
        "'s16.u5' for codes 0..31, 's16.s6' for -32..31, ...), uint8 [N, K/256 * 32 * bits] (s16.h, 'Packed "
        "codes'), or q8_0's ('q8_0.s5' for codes -16..15, uint8 [N, K/32 * 20]; 'q8_0.nl4' for codes among "
        "IQ4_NL's 16 values, uint8 [N, K/2]) (q8_packed.h).");
  m.def("half_linear", nb::overload_cast<const l::Array&, const l::Array&, const l::Array&>(&l::half_linear), "x"_a,
        "w"_a, "out"_a,
        "out[M, N] = x[M, K] @ W^T, W [N, K] float16 or bfloat16 (a GGUF F16 / BF16 matrix kept 16-bit), x float32; "
        "per output eight fma lanes over k % 8 then a fixed sum, so a row's bits never depend on the call (half.h).");
  m.def("linear_reads_packed_q8", [] { return l::active_kernels().q8_reads_packed; },
        "Whether the active linear ISA reads q8_0's 5-bit packed codes ('q8_0.s5') in place; the others unpack "
        "them per work item (same bits, slower than bytes there: q8_packed.h).");
  m.def("linear_reads_q8_table", [] { return l::active_kernels().q8_reads_table; },
        "Whether the active linear ISA reads q8_0's IQ4_NL table indices ('q8_0.nl4') in place; the others "
        "unpack them per work item (same bits, slower than bytes there: q8_packed.h).");
  m.def("s16_panel_rows", &l::s16_panel_rows,
        "Calls of up to this many rows read s16 weight panels in place, more take the tiles (same bits; s16.h): "
        "48 on AMD, 12 elsewhere, or PAGED_S16_PANEL_ROWS.");
  m.def("set_s16_panel_rows", &l::set_s16_panel_rows, "rows"_a,
        "Set s16_panel_rows() (8 .. 4096; 0: the CPU's default), between calls.");
  m.def("nibble_panel_rows", &l::nibble_panel_rows,
        "Calls of up to this many rows read 4-bit and packed q8_0 weight panels in place, more take the tiles (same "
        "bits; int8.h): 8 on AMD, 1 elsewhere, or PAGED_NIBBLE_PANEL_ROWS.");
  m.def("set_nibble_panel_rows", &l::set_nibble_panel_rows, "rows"_a,
        "Set nibble_panel_rows() (1 .. 8; 0: the CPU's default), between calls.");
  m.def("weight_panel_layout", &l::weight_panel_layout,
        "The active linear ISA's persistent weight panel layout (e.g. 'avx512/2'), '' when it has none.");
  m.def("weight_panel_bytes", &l::weight_panel_bytes, "qtype"_a, "qs"_a, "d"_a, "m"_a.none(),
        "Bytes of build_weight_panels' tensor for this weight under the active linear ISA.");
  m.def("unpack_weight_panels", &l::unpack_weight_panels, "qtype"_a, "panels"_a, "qs"_a, "d"_a, "m"_a.none(),
        "first_row"_a = 0,
        "build_weight_panels' inverse: writes the weight's qs, d and m (compact where the panels' are) back from "
        "its panels, bit for bit, under any linear ISA of this CPU; the arrays hold its rows from first_row on "
        "(a multiple of 32).");
  m.def("build_weight_panels", &l::build_weight_panels, "qtype"_a, "qs"_a, "d"_a, "m"_a.none(), "out"_a,
        "Builds the weight's int8 panels (the int8 kernel's per-call layout, once) into out, a 64-byte aligned "
        "uint8 tensor of weight_panel_bytes bytes, for quant_linear's panels.");
  m.def("bf16_prompt_supported", &l::bf16_prompt_supported,
        "Whether bf16_linear runs here: AMX-BF16 tiles (and AVX-512), granted by the OS, not hidden by PAGED_CPU_HIDE.");
  m.def("bf16_weight_elems", &l::bf16_weight_elems, "N"_a, "K"_a,
        "Elements of build_bf16_weight's tile layout of an [N, K] weight (N rounded up to 32, times K).");
  m.def("build_bf16_weight", &l::build_bf16_weight, "w16"_a, "out"_a,
        "out (bfloat16, bf16_weight_elems(N, K)) = the bfloat16 [N, K] weight w16 in bf16_linear's tile layout.");
  m.def("bf16_linear", &l::bf16_linear, "x"_a, "weight"_a, "out"_a,
        "out[M, N] = bf16(x[M, K]) @ W^T with float32 sums on AMX-BF16 tiles, W given by build_bf16_weight's "
        "tensor; batch invariant (docs/kernels.md, 'bfloat16 prompt rows').");
  m.attr("LINEAR_INT16_MAX_ROWS") = l::kInt16MaxRows;  // calls with more rows take the fp32 path
  m.def("linear_isa", &l::current_isa, "SIMD build the quantized linear uses now.");
  m.def("set_linear_isa", &l::set_isa, "name"_a, "Choose 'auto' or a build of supported_linear_isas() ('avx512', 'avxvnni', 'avx2', 'scalar'): all "
        "paths of that build.");
  m.def("supported_linear_isas", &l::supported_isas, "Quantized linear builds this CPU can run, best first.");
}
}  // namespace paged::cpu
