"""Linear layers over packed GGUF blocks on the CPU (paged._C_cpu.quant_linear).

Holds one matrix in the kernel's layout and exposes ``linear(x, bias)``, the
method the model's ``linear`` helper dispatches to for non-tensor weights.
The kernel takes float32 activations (others are converted; the result
comes back in the input's dtype). Calls of at most 2 rows (decode of one or
two sequences) split each 32-value block of x into two int16 terms
(x = s*hi + s/65536*lo to ~2^-32 of the block's largest value) and take exact
integer dot products with the weight codes; calls of more rows multiply fp32
x by the codes as floats. Both accumulate in float32, so results match the
dense float32 path to fp32 rounding (a different summation order), but a
row's bits depend on whether its call had <= 2 rows (docs/kernels.md,
"Quantized linear (CPU)").

``activations="int8"`` (the constructor's setting) instead quantizes x to
int8 per 32-value block (llama.cpp's q8 activations) for calls of any size
and takes integer dot products: faster from a few rows on, ~0.3% relative
error per output (the int8 rounding of x), and a row's bits are the same
whatever the call's size, thread count or SIMD build (batch invariant). The
dense prefill branch below is never taken in that mode.

``activations="int8x2"`` adds a second int8 term, the residual x - dx*xq
quantized the same way: ~15 bits of x per block (greedy output as faithful as
float32 activations on the accuracy gate), still batch invariant, at about
twice int8's integer work (the weight unpacking is shared).

F16 and BF16 matrices (layouts "f16" / "bf16") keep their 16-bit values
and multiply float32 x under every ``activations`` setting
(``_C_cpu.half_linear``: exact products, a fixed summation order per output,
so batch invariant like the int8 paths, and as accurate as float32 math on the
dequantized weight); they have no integer codes for the int8 paths to take
(docs/cpu-linear.md, "F16 and BF16 weights").

Weight panels (int8 paths, avx512 build): calls of more than 8 rows make the
kernel widen each 32-row chunk's codes and transpose its scales into a panel
before sweeping it; ``use_panels`` keeps that panel for the whole matrix
(``_C_cpu.build_weight_panels``, built on first use and again when the linear
ISA changed) and passes it on every call: the kernel reads only it, with the
same bits, as many bytes as the packed matrix (the transposed nibbles or q8
codes, the scales kept fp16 or compact), so the matrix drops its packed
arrays (``release_packed``) and unpacks them again only for a path without
panels. ``plan_weight_panels`` switches it on for a model (docs/cpu-linear.md,
"Weight panels"; docs/weight-panels.md).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from paged.backends.cpu.attention import dl
# HALF_LAYOUTS run on _C_cpu.half_linear whatever the activations
from paged.core.models.loaders.quant_layouts import HALF_LAYOUTS, packed_code_bits, q8_code_form, s16_code_form

if TYPE_CHECKING:  # only a type: a backend needs nothing from the loaders at run time
    from paged.core.models.loaders.packed import PackedBlocks


#: Row count from which a call dequantizes the matrix into a scratch buffer and
#: runs torch's dense fp32 GEMM (prefill chunks): ~1.6x faster there than the
#: packed kernel, whose per-block scaling caps it at about half of peak FLOPs.
#: Those rows equal the packed paths' to fp32 rounding (the packed kernel's
#: two-term int16 or fp32 activations), not bitwise, so a
#: prompt prefilled in one large chunk or in small ones may differ in the last
#: bits. PAGED_DENSE_PREFILL_ROWS=0 keeps every call on the packed kernel.
DENSE_ROWS = int(os.environ.get("PAGED_DENSE_PREFILL_ROWS", "256"))


#: s16 matrices keep their codes packed into the fewest bits that hold them
#: (2-6: Q2_K's in 2, Q3_K's in 3, Q5_K's in 5, Q6_K's in 6; csrc_cpu/linear/s16.h, "Packed codes"),
#: unpacked per work item, same bits; PAGED_S16_PACKED=0 keeps a byte per
#: code (for paired timing).
PACK_S16_CODES = os.environ.get("PAGED_S16_PACKED", "1") != "0"
#: and for rows whose K is not a multiple of 256, 5-bit codes per 32-block
#: ("s16.u5b") and fp16 half-pair scales (Q5_1 / Q5_0 there: _half_pairs);
#: PAGED_S16_BLOCKS=0 keeps those rows' bytes and float32 scales (paired timing)
PACK_S16_BLOCKS = os.environ.get("PAGED_S16_BLOCKS", "1") != "0"
#: s16 codes of 2 or 3 bits (Q2_K's, Q3_K's) packed in as many bits; PAGED_S16_NARROW=0 packs them
#: in 4 as before (paired timing)
S16_MIN_BITS = 2 if os.environ.get("PAGED_S16_NARROW", "1") != "0" else 4


def pack_q8_codes() -> bool:
    """Whether q8_0 matrices whose codes all lie in -16..15 (GGUF's Q5_0,
    llama.cpp's fallback for K-quant rows not a multiple of 256) keep them
    in 5 bits ("q8_0.s5", csrc_cpu/linear/q8_packed.h; same bits):
    PAGED_Q8_PACKED "auto" (the default: where the active linear build reads
    them in place, every x86 build past scalar; scalar and NEON would unpack
    them per work item, slower than bytes), "1" (always) or "0" (bytes)."""
    from paged import _C_cpu

    value = os.environ.get("PAGED_Q8_PACKED", "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"PAGED_Q8_PACKED: expected '0', '1' or 'auto', got {value!r}")
    return value == "1" or (value == "auto" and _C_cpu.linear_reads_packed_q8())


def pack_q8_table() -> bool:
    """Whether q8_0 matrices whose codes are all IQ4_NL table values (GGUF's
    IQ4_NL) keep their 4-bit indices ("q8_0.nl4", csrc_cpu/linear/q8_packed.h;
    same bits): PAGED_Q8_TABLE "auto" (the default: where the active linear
    build reads them in place, every x86 build past scalar; scalar and NEON
    would unpack them per work item, slower than bytes: 1B IQ4_NL decode
    0.8-0.85x on the avx2 build before it read them), "1" (always) or "0"
    (bytes)."""
    from paged import _C_cpu

    value = os.environ.get("PAGED_Q8_TABLE", "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"PAGED_Q8_TABLE: expected '0', '1' or 'auto', got {value!r}")
    return value == "1" or (value == "auto" and _C_cpu.linear_reads_q8_table())

log = logging.getLogger(__name__)

#: What the kernel multiplies the weight codes by (``_C_cpu.quant_linear``'s
#: ``activations``), "mixed": int8 for every row of the O, gate/up and down
#: projections of ``one_term_layers``, int8x2 for every other matrix (QKV
#: and the LM head included); and "mixed-bf16": int8x2 for rows that generate
#: a token, bfloat16 on AMX tiles for every prompt row (``quant_linear``'s
#: ``prompt_rows="bf16"``, tiles made from the int8 panels: no bfloat16 copy;
#: CPUs with AMX-BF16 only).
ACTIVATIONS = ("float32", "int8", "int8x2", "mixed", "mixed-bf16")


def _one_of(names) -> str:
    """'a', 'b' or 'c' (the kernel's own wording)."""
    quoted = [repr(n) for n in names]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_activations(activations: str) -> str:
    """``activations`` itself when it names a mode, else ValueError."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected {_one_of(ACTIVATIONS)}, got {activations!r}")
    return activations


def bf16_prompt_supported() -> bool:
    """Whether "mixed-bf16" runs here: AMX-BF16 tiles granted by the OS, not
    hidden by PAGED_CPU_HIDE, and the linear kernels at the avx512 level (a
    process capped at an older level, backends/cpu/host/isa.py use_level, runs
    what that generation would)."""
    from paged import _C_cpu

    return bool(_C_cpu.bf16_prompt_supported()) and _C_cpu.linear_isa() in ("avx512", "amx")


def resolve_activations(setting: str) -> str:
    """An engine setting ("auto" or one of ACTIVATIONS) as the mode to build
    CpuPackedLinear with. "auto" is the fastest mode that passes the accuracy
    gate (docs/kernels.md, "Choosing the CPU path"): "mixed-bf16" where the
    CPU has AMX-BF16, else "mixed" (int8x2 where K/V is cached and where a
    token is generated outside the middle layers, int8 for the rest)."""
    if setting == "auto":
        return "mixed-bf16" if bf16_prompt_supported() else "mixed"
    if setting not in ACTIVATIONS:
        raise ValueError(f"linear activations: expected {_one_of(('auto',) + ACTIVATIONS)}, got {setting!r}")
    if setting == "mixed-bf16" and not bf16_prompt_supported():
        raise ValueError("linear activations: 'mixed-bf16' needs AMX-BF16 tiles, which this CPU (or its OS, or "
                         "PAGED_CPU_HIDE) does not offer; 'mixed' is the same with int8 prompt rows")
    return setting


def one_term_layers(num_layers: int) -> range:
    """The decoder layers whose O, gate/up and down projections "mixed"
    computes on one int8 term, every row: all but the first and last fifth
    (rounded up). Chosen on the accuracy gate's tuning half
    (docs/accuracy.md): greedy output and perplexity are most sensitive to
    the outer layers, and a row's role (prompt or generating) does not
    change its arithmetic."""
    edge = -(-num_layers // 5)
    return range(edge, max(edge, num_layers - edge))


def available() -> bool:
    try:
        from paged import _C_cpu
    except ImportError:
        return False
    return hasattr(_C_cpu, "quant_linear")


class CpuPackedLinear:
    """One packed matrix. ``activations``: "float32" (default; the exact
    paths, dense GEMM from DENSE_ROWS rows), "int8" (int8 activations at
    every M) or "int8x2" (two int8 terms at every M). Pass ``functools.partial(CpuPackedLinear, activations=...)`` as
    the model's ``packed_linear`` to choose it for a whole model; the layer
    stack follows its layers' setting."""

    #: core/models/decoder.py may hand it a PackedParts (a fused matrix of several layouts)
    takes_row_parts = True

    def __init__(self, packed: PackedBlocks, activations: str = "float32", one_term: bool = False):
        self.activations = check_activations(activations)
        if self.activations == "mixed-bf16":
            resolve_activations(self.activations)  # ValueError where the CPU cannot run it
        self.qtype = packed.kernel_type
        # a PackedParts' row groups, each a matrix of its own whose outputs linear() joins
        self.parts = [CpuPackedLinear(p, activations, one_term) for p in packed.parts] \
            if packed.kernel_type == "parts" else None
        qs, d, m = (None, None, None) if self.parts else packed.fields()
        # the kernels' name for the layout: s16's codes packed into 2-6 bits ("s16.u5", ...) and
        # q8_0's into 5 ("q8_0.s5") or IQ4_NL table indices ("q8_0.nl4") where they fit
        self.kernel_qtype = self.qtype
        blocks = packed.shape[1] % 256 != 0  # s16 rows without compact scales or 256-groups
        s16_packs = self.qtype == "s16" and PACK_S16_CODES and (PACK_S16_BLOCKS or not blocks)
        if s16_packs or (self.qtype == "q8_0" and (pack_q8_table() or pack_q8_codes())):
            qs, self.kernel_qtype = _packed_codes(qs, self.qtype)
        if s16_packs and blocks and d is not None and d.dtype == torch.float32:
            d, m = _half_pairs(d, m)
        self._arrays: tuple | None = (qs, d, m)  # None while only the panels hold them (release_packed)
        self._released: list = []  # the released arrays' (shape, dtype)
        self.out_features, self.in_features = packed.shape
        self.nbytes = packed.nbytes
        self.use_panels = False  # persistent weight panels (plan_weight_panels)
        # "mixed" only: every row takes one int8 term here, else two (the O,
        # gate/up and down projections of one_term_layers: the precision plan's)
        if one_term and self.activations != "mixed":
            raise ValueError(f"one_term: expected False unless activations are 'mixed', got True with "
                             f"activations {self.activations!r}")
        self.one_term = bool(one_term)
        self._panels: torch.Tensor | None = None
        self._panels_layout = ""  # the linear build _panels were built for

    # The packed arrays (quant_linear's qs, d, m). A matrix whose persistent
    # panels hold every bit of them may drop them (release_packed); reading
    # one then unpacks them from the panels again (unpack_weight_panels), for
    # the paths that do not read panels (another linear build, an embedding
    # lookup), and keeps them.
    @property
    def qs(self) -> torch.Tensor | None:
        return self._packed_arrays()[0]

    @property
    def d(self) -> torch.Tensor | None:
        return self._packed_arrays()[1]

    @property
    def m(self) -> torch.Tensor | None:
        return self._packed_arrays()[2]

    def _packed_arrays(self) -> tuple:
        if self._arrays is None:
            self._arrays = self._unpacked(0, self.out_features)
        return self._arrays

    def _unpacked(self, first: int, rows: int) -> tuple:
        """Rows [first, first + rows) of the released arrays, unpacked from the panels."""
        from paged import _C_cpu

        arrays = tuple(None if spec is None else torch.empty((rows, *spec[0][1:]), dtype=spec[1])
                       for spec in self._released)
        _C_cpu.unpack_weight_panels(self.kernel_qtype, dl(self._panels), *map(dl, arrays), first)
        return arrays

    @property
    def row_groups(self) -> list:
        """The matrices its calls run: its row parts, or itself."""
        return self.parts or [self]

    @property
    def packed_released(self) -> bool:
        """Whether only the panels hold the packed arrays now (release_packed)."""
        return self._arrays is None

    def release_packed(self) -> int:
        """Drops the packed arrays where the persistent panels hold them (the
        kernels read only the panels then): at most the matrix's packed bytes
        less in memory. Returns the bytes dropped."""
        if self._arrays is None or self.weight_panels() is None:
            return 0
        self._released = [None if t is None else (tuple(t.shape), t.dtype) for t in self._arrays]
        dropped = sum(t.numel() * t.element_size() for t in self._arrays if t is not None)
        self._arrays = None
        return dropped

    def kernel_arrays(self, panels: torch.Tensor | None) -> tuple:
        """quant_linear's qs, d, m beside ``panels``: the packed arrays, or
        after release_packed stand-ins of their shapes and dtypes over the
        panels' own bytes (a call given panels reads only them: quant_linear
        checks the arrays' shapes and nothing reads their memory)."""
        if self._arrays is not None or panels is None:
            return self._packed_arrays()
        # the panels are larger than each array
        return tuple(None if spec is None else panels[:torch.Size(spec[0]).numel() * spec[1].itemsize]
                     .view(spec[1]).view(spec[0]) for spec in self._released)

    def weight_panels(self) -> torch.Tensor | None:
        """The matrix's persistent int8 panels for the active linear build
        (built now if missing or built for another), or None when
        ``use_panels`` is off, the activations are float32 or the build has
        no panel layout."""
        from paged import _C_cpu

        if not self.use_panels or self.activations == "float32" or not has_panel_layout(self.kernel_qtype):
            return None
        layout = _C_cpu.weight_panel_layout()
        if not layout:
            return None
        if layout != self._panels_layout:
            panels = torch.empty(_C_cpu.weight_panel_bytes(self.kernel_qtype, dl(self.qs), dl(self.d), dl(self.m)),
                                 dtype=torch.uint8)
            _C_cpu.build_weight_panels(self.kernel_qtype, dl(self.qs), dl(self.d), dl(self.m), dl(panels))
            self._panels, self._panels_layout = panels, layout
        return self._panels

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               first_prompt_row: int | None = None, kv_projection: bool = False) -> torch.Tensor:
        """x @ W^T + bias. ``first_prompt_row``: the rows from there on are
        prompt rows (their tokens are known), which "mixed-bf16" computes in
        bfloat16; None: every row generates (or the caller does not say).
        "mixed" computes every row alike: one int8 term where ``one_term``
        (never for ``kv_projection``, whose outputs are the cached K/V), two
        elsewhere."""
        from paged import _C_cpu

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        rows = x2.shape[0]
        if self.parts:
            out = torch.cat([p.linear(x2, None, first_prompt_row, kv_projection) for p in self.parts], dim=1)
            if bias is not None:
                out += bias
        elif self.qtype in HALF_LAYOUTS:
            out = torch.empty((rows, self.out_features), dtype=torch.float32)
            _C_cpu.half_linear(dl(x2), dl(self.qs), dl(out))
            if bias is not None:
                out += bias
        elif self.activations == "float32" and (0 < DENSE_ROWS <= rows or self.qtype == "s16"):
            out = F.linear(x2, self._dequantized(), bias)  # s16 has no float32-activation kernel
        else:
            out = torch.empty((rows, self.out_features), dtype=torch.float32)
            split = -1 if first_prompt_row is None else min(first_prompt_row, rows)
            if self.activations == "mixed-bf16" and self.qtype == "s16":  # no bfloat16 tiles: two terms
                self._packed(x2, out, "int8x2", -1)
            elif self.activations == "mixed-bf16":  # prompt rows in bfloat16, QKV's too
                self._packed(x2, out, "int8x2", split, "bf16")
            elif self.activations == "mixed":  # two_term_rows 0: every row on one term, as "int8"
                self._packed(x2, out, "int8x2", 0 if self.one_term and not kv_projection else -1)
            else:
                self._packed(x2, out, self.activations, -1)
            if bias is not None:
                out += bias
        return out.view(*lead, self.out_features).to(x.dtype)

    def _packed(self, x2: torch.Tensor, out: torch.Tensor, activations: str, two_term_rows: int,
                prompt_rows: str = "int8") -> None:
        """quant_linear on the packed weight, with the persistent panels where on."""
        from paged import _C_cpu

        panels = self.weight_panels()  # the kernel decides per call whether to read them
        qs, d, m = self.kernel_arrays(panels)
        _C_cpu.quant_linear(dl(x2), self.kernel_qtype, dl(qs), dl(d), dl(m), dl(out), activations,
                            two_term_rows, None if panels is None else dl(panels), prompt_rows)

    def _dequantized(self) -> torch.Tensor:
        """The dense fp32 matrix, in a scratch buffer shared by every packed
        weight of the same shape (one matrix is in use at a time)."""
        from paged import _C_cpu

        buf = _SCRATCH.get(self.shape)
        if buf is None:
            buf = _SCRATCH[self.shape] = torch.empty(self.shape, dtype=torch.float32)
        _C_cpu.quant_dequantize(self.kernel_qtype, dl(self.qs), dl(self.d), dl(self.m), dl(buf))
        return buf

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of the matrix, dequantized (exactly gguf's values): an
        embedding table looked up without a float copy of the whole table."""
        from paged.core.models.loaders.quant_layouts import dequantize_layout

        if self.parts:
            raise ValueError("embedding: expected a matrix of one layout, got a fused matrix of row parts")
        flat = ids.reshape(-1)
        if self.packed_released:  # a tied LM head whose panels hold it: only the looked-up rows' chunks
            return self._rows_from_panels(flat).to(dtype).view(*ids.shape, self.in_features)
        picked = [None if t is None else t[flat] for t in (self.qs, self.d, self.m)]
        if self.qtype in HALF_LAYOUTS:
            rows = dequantize_layout(self.qtype, *picked)
        else:  # the kernels' dequantizer on the picked rows (torch's ops took ~0.35 ms a decode step at 1B)
            rows = self._dequantize_rows(picked)
        return rows.to(dtype).view(*ids.shape, self.in_features)

    def _dequantize_rows(self, arrays) -> torch.Tensor:
        from paged import _C_cpu

        rows = torch.empty((arrays[0].shape[0], self.in_features), dtype=torch.float32)
        _C_cpu.quant_dequantize(self.kernel_qtype, *map(dl, arrays), dl(rows))
        return rows

    def _rows_from_panels(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows ``flat`` of a matrix that keeps only its panels, unpacked one
        32-row chunk at a time (unpack_weight_panels' first_row), so a lookup
        leaves the matrix without its packed arrays."""
        out = torch.empty((flat.numel(), self.in_features), dtype=torch.float32)
        chunk = flat // PANEL_ROWS
        for c in torch.unique(chunk).tolist():
            first = c * PANEL_ROWS
            arrays = self._unpacked(first, min(PANEL_ROWS, self.out_features - first))
            at = chunk == c
            out[at] = self._dequantize_rows(arrays)[flat[at] - first]
        return out


def _packed_codes(codes: torch.Tensor, layout: str) -> tuple[torch.Tensor, str]:
    """quant_layouts.pack_s16_codes' or pack_q8_codes' result for the
    ``layout`` ("s16" or "q8_0"), packed by the extension (its rows in
    parallel: a tenth of the torch ops' time, which doubled a 1B Q5_K_M
    file's load); bytes stay as they are."""
    from paged import _C_cpu

    if layout == "s16":
        qtype = s16_code_form(codes, S16_MIN_BITS)
    else:
        qtype = q8_code_form(codes, five_bits=pack_q8_codes(), table=pack_q8_table())
    if qtype == layout:
        return codes, qtype
    n, k = codes.shape
    per_block = layout == "q8_0" or qtype.endswith("b")  # 20 bytes per 32-block (csrc_cpu/linear/q8_packed.h)
    row_bytes = k // 2 if qtype == "q8_0.nl4" else k // 32 * 20 if per_block else k // 256 * 32 * packed_code_bits(qtype)[0]
    out = torch.empty((n, row_bytes), dtype=torch.uint8)
    _C_cpu.pack_codes(dl(codes), qtype, dl(out))
    return out, qtype


def _half_pairs(d: torch.Tensor, m: torch.Tensor | None) -> tuple:
    """s16's float32 scales (and offsets) [N, K/16] as fp16 [N, K/32] when
    each block's two halves hold one fp16 value (Q5_1's and Q5_0's d and m,
    repeated per half: csrc_cpu/linear/s16.h, "Half-pair scales"), else as
    they are: 0.125 bytes a weight where they were 0.5, for the rows whose
    K is not a multiple of 256 (those have no compact scales)."""
    def pairs(t: torch.Tensor):
        first = t[:, 0::2]
        half = first.half()
        exact = torch.equal(first, t[:, 1::2]) and torch.equal(half.float().view(torch.int32), first.view(torch.int32))
        return half.contiguous() if exact else None

    hd, hm = pairs(d), None if m is None else pairs(m)
    if hd is None or (m is not None and hm is None):
        return d, m
    return hd, hm


_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}
#: the layouts with persistent weight panels (the avx512 build's q4/q8 tiles, q8_0's packed codes too),
#: and s16's codes packed into 2-6 bits ("s16.u5", ...: has_panel_layout)
PANEL_LAYOUTS = ("q4_0", "q4_1", "q8_0", "q8_0.s5", "q8_0.nl4")


def has_panel_layout(kernel_qtype: str) -> bool:
    """Whether a matrix of this kernel qtype can keep persistent panels."""
    return kernel_qtype in PANEL_LAYOUTS or (kernel_qtype.startswith("s16.") and not kernel_qtype.endswith("b"))
#: weight rows per panel chunk (csrc_cpu/linear/int8.h kI8ChunkRows)
PANEL_ROWS = 32


def panels_setting() -> str:
    """PAGED_CPU_WEIGHT_PANELS: "0" (off), "1" (on whatever the size) or
    "auto" (the default: on, as "1"; panels replace the packed arrays, so
    they cost no memory and are kept at any model size)."""
    value = os.environ.get("PAGED_CPU_WEIGHT_PANELS", "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"PAGED_CPU_WEIGHT_PANELS: expected '0', '1' or 'auto', got {value!r}")
    return value


def plan_weight_panels(linears) -> int:
    """Sets ``use_panels`` on the int8-path matrices of one model
    (``linears``: its CpuPackedLinear objects, others are skipped) by
    panels_setting(), builds their panels for the active linear build (the
    layer stack takes them at construction) and logs once what they take.
    Returns the panel bytes (0 when off or the build has none). A panel
    holds as many bytes as the packed matrix (its scales stay fp16 values
    or compact, Q4_K's bytes and supers, as the kernels widen them) and
    every bit of it, so the matrix then drops its packed arrays
    (release_packed): one copy of the weights in memory."""
    from paged import _C_cpu

    setting = panels_setting()
    # a fused matrix of row parts (Q4_K_M's QKV: Q/K in q4_1, V in s16): each part has panels of its own
    flat = [p for w in linears if isinstance(w, CpuPackedLinear) for p in w.row_groups]
    mats = [w for w in flat if w.activations != "float32" and has_panel_layout(w.kernel_qtype)]
    if not mats:
        return 0
    on = setting != "0"
    layout = _C_cpu.weight_panel_layout()
    for w in mats:
        w.use_panels = on
    if not on or not layout:
        why = f"linear ISA {_C_cpu.linear_isa()!r} has none" if on else "PAGED_CPU_WEIGHT_PANELS=0"
        log.info("cpu weight panels: off (%s)", why)
        return 0
    # calls of up to this many rows read s16 / 4-bit panels in place, more take the tiles (csrc_cpu/linear/
    # s16.h, int8.h): asked here so that a bad PAGED_S16_PANEL_ROWS / PAGED_NIBBLE_PANEL_ROWS stops the load
    # with its ValueError, not a step
    panel_rows = _C_cpu.s16_panel_rows(), _C_cpu.nibble_panel_rows()
    total = dropped = 0
    for w in mats:  # each matrix's panels, then its packed arrays dropped: memory peaks at one matrix over
        total += w.weight_panels().numel()
        dropped += w.release_packed()
    log.info("cpu weight panels: %.0f MiB for %d matrices, in place of their packed arrays (%.0f MiB; %s; "
             "read in place up to %d rows for s16, %d for 4-bit; PAGED_CPU_WEIGHT_PANELS=0 turns them off)",
             total / 2**20, len(mats), dropped / 2**20, layout, *panel_rows)
    return total
