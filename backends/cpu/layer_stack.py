"""All decoder layers of a CPU step in one extension call (paged._C_cpu.LayerStack).

Batch-1 decode is bound by Python around the kernels: the Python path makes
~10 extension calls per layer, each with a DLPack capsule per tensor and a
torch allocation for its output. ``LayerStack`` runs the same kernels with the
same arguments in the same order from C++ (csrc_cpu/model/layer_stack.h), so
its hidden states and KV caches are bitwise those of the Python path, which
stays the fallback (and the tests' oracle).

It executes each layer's description (core/models/spec.py), handed over as
data at ``add_layer``: RMSNorms before attention and MLP and, where the
layer has them, of the attention and MLP outputs (Gemma 3), per-head Q/K
RMSNorm (Qwen3, Gemma 3), a Q/K/V bias (Qwen2), a SiLU- or GELU-tanh-gated
MLP, the layer's own rotary table (Gemma 3's local and global bases,
LongRoPE, partial rotary: the table's width), window and attention scale.
What it has no kernels for it declines, naming it (``decline_reason``):
LayerNorm, an ungated MLP, f16 / bf16 matrices (half_linear has no call
from the stack yet); the model then runs on the Python layers. A mixture of
experts runs its layers here too: routing (``moe_route``) and the experts
(``MoeExperts.forward``) in C++, the calls the Python layer makes
(``add_layer(moe=...)``, a shared expert and its gate included); a layer
with a packed router, or experts whose panels belong to another linear
build, calls back into Python for the MLP (``add_layer(mlp=...)``: the layer's own ``MoeMlp``).
Either way its bits are the Python layers'.

The CPU worker attaches it to the model (backends/cpu/worker.py), which
describes itself through ``decoder_stack()``. Eligible models besides their
shape: CPU, float32, the fused CPU layer ops (``accepts``), every layer's
matrices packed (``CpuPackedLinear``, all with the same ``activations``) and
attention on ``CpuBackend``. The stack runs the packed kernel with its
layers' ``activations``: with "float32", steps of ``DENSE_ROWS`` tokens or
more keep the Python path (they run a dense GEMM there); with "int8" or
"int8x2" the stack runs every step. Matrices with persistent weight panels
(``CpuPackedLinear.weight_panels``, planned before the stack is built) hand
the stack the same tensors; it uses them while they match the active linear
build. ``PAGED_LAYER_STACK=0`` turns the stack off (read on
every step).

Single-threaded: a stack belongs to the engine thread that runs the model.
"""

from __future__ import annotations

import os
import weakref

import torch

from paged.backends.cpu.attention import CpuBackend, dl
from paged.backends.cpu import quant_linear as packed_linear
from paged.backends.cpu.layer_ops import CpuFusedLayerOps
from paged.backends.cpu.quant_linear import HALF_LAYOUTS, CpuPackedLinear

__all__ = ["LayerStack", "enabled", "decline_reason"]


def enabled() -> bool:
    """False when ``PAGED_LAYER_STACK=0`` (benchmarks and debugging)."""
    return os.environ.get("PAGED_LAYER_STACK", "1") != "0"


def _matrix(w: CpuPackedLinear):
    """add_layer's (qtype, qs, d, m): beside the matrix's panels, what its own
    calls pass (CpuPackedLinear.kernel_arrays: stand-ins once released)."""
    qs, d, m = w.kernel_arrays(w.weight_panels())
    return (w.kernel_qtype, dl(qs), dl(d), None if m is None else dl(m))


def native_layout() -> str:
    from paged import _C_cpu

    return _C_cpu.weight_panel_layout()


def _row_parts(w: CpuPackedLinear) -> list:
    """add_layer's qkv: the matrix's row parts (quant_linear.CpuPackedLinear.parts), or itself."""
    return [_matrix(p) for p in w.row_groups]


def _layouts(w: CpuPackedLinear) -> list:
    return [p.qtype for p in w.row_groups]


def _panels(mats) -> list:
    """Each matrix's persistent weight panels (None where off), the tensors
    its CpuPackedLinear passes, so both paths read the same bytes."""
    panels = [w.weight_panels() for w in mats]
    return [] if all(p is None for p in panels) else [None if p is None else dl(p) for p in panels]


def _part_panels(w: CpuPackedLinear) -> list:
    """add_layer's qkv_part_panels: each row part's panels, for a matrix of several parts ([] otherwise)."""
    return _panels(w.parts) if w.parts else []


def _layer_shape(layer) -> dict:
    """add_layer's description of one layer (csrc_cpu/model/layer_stack.h LayerShape)."""
    s, attn = layer.spec, layer.attn_backend
    opt = lambda t: None if t is None else dl(t)  # noqa: E731
    shape = dict(scale=float(attn.scale), sliding_window=int(attn.sliding_window or 0),
                 cos_sin=dl(layer.rope.cos_sin_cache), attn_out_norm=opt(layer.attn_out_norm),
                 mlp_out_norm=opt(layer.mlp_out_norm), q_norm=opt(layer.q_norm), k_norm=opt(layer.k_norm))
    if s is not None:
        shape.update(eps=float(s.attn_norm.eps), activation=s.mlp.activation)
        if s.attention.qk_norm is not None:
            shape["qk_eps"] = float(s.attention.qk_norm.eps)
    return shape


def _dense_f32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"


def _own_backend(attn):
    """A layer's attention backend (a LayerAttention's own: core/models/layer_attention.py)."""
    return getattr(attn, "backend", attn)


def _layer_matrices(layer) -> tuple:
    """The packed matrices the stack calls: a mixture-of-experts layer's MLP
    is its Python callable's (``_python_mlp``)."""
    if getattr(layer, "moe", None) is not None:
        return (layer.qkv, layer.o_proj)
    return (layer.qkv, layer.o_proj, layer.gate_up, layer.down)


def _python_mlp(model, layer):
    """add_layer's mlp for a mixture-of-experts layer: the Python layer's own
    call (DecoderLayer.forward's ``self.moe(x, ops, first_prompt_row)``), on
    the model's current layer ops. The model by a weak reference: the native
    stack, which the model holds, keeps the callable, and a cycle through it
    is one Python's collector cannot see (the model would never be freed)."""
    moe, owner = layer.moe, weakref.ref(model)

    def mlp(x: torch.Tensor, first_prompt_row):
        return moe(x, owner().ops, first_prompt_row).contiguous()

    return mlp


def _native_moe(model, layer):
    """add_layer's moe: the layer's one-call CPU experts with its router and
    shared expert set (CpuMoeExperts.for_stack), which the stack then routes
    and runs in C++ (ops moe_route and the same kernels: the Python call's
    bits); None for a packed router, a shared expert the call cannot take
    or no one-call experts (the stack calls ``_python_mlp``)."""
    moe = layer.moe
    fused = moe._fused_experts(model.ops)
    if not hasattr(fused, "for_stack"):
        return None
    return fused.for_stack(moe.router, moe.spec, moe.shared, moe.shared_gate)


def shape_decline(stack) -> str | None:
    """What of the description (``stack``: a model's ``decoder_stack()``)
    the C++ stack has no kernels for, or None where it runs every layer."""
    if stack.spec is not None and stack.spec.final_norm.kind != "rms":
        return "a LayerNorm final norm"
    for i, layer in enumerate(stack.layers):
        s = layer.spec
        if s is None:
            continue
        norms = [n for n in (s.attn_norm, s.mlp_norm, s.attn_post_norm, s.mlp_post_norm) if n is not None]
        if any(n.kind != "rms" for n in norms + [s.attention.qk_norm] if n is not None):
            return f"layer {i}: LayerNorm"
        if len({n.eps for n in norms}) != 1:
            return f"layer {i}: norms of several eps"
        if not s.mlp.gated:
            return f"layer {i}: an ungated MLP"
    return None


def decline_reason(model) -> str | None:
    """Why ``model`` runs on the Python layers rather than the C++ stack, or
    None where the stack takes it (see the module docstring)."""
    try:
        from paged import _C_cpu
    except ImportError:
        return "the CPU extension is not built"
    spec = model.decoder_stack()
    layers = spec.layers
    if not hasattr(_C_cpu, "LayerStack") or not layers:
        return "no LayerStack in the extension"
    if spec.device.type != "cpu" or spec.dtype != torch.float32 or not _dense_f32(spec.final_norm):
        return "not a float32 CPU model"
    reason = shape_decline(spec)
    if reason:
        return reason
    backend = _own_backend(layers[0].attn_backend)
    if type(backend) is not CpuBackend or backend.dtype != torch.float32:
        return "attention not on a float32 CpuBackend"
    activations = set()
    for i, layer in enumerate(layers):
        mats = _layer_matrices(layer)
        norms = (layer.input_norm, layer.post_norm, layer.attn_out_norm, layer.mlp_out_norm, layer.q_norm,
                 layer.k_norm, layer.qkv_bias)
        if not all(isinstance(w, CpuPackedLinear) for w in mats):
            return f"layer {i}: a matrix not packed"
        if _own_backend(layer.attn_backend) is not backend or not all(n is None or _dense_f32(n) for n in norms):
            return f"layer {i}: another backend or a norm not float32"
        if layer.rope is None or not _dense_f32(layer.rope.cos_sin_cache):
            return f"layer {i}: no float32 rotary table"
        activations.update(w.activations for w in mats)
        if len({w.one_term for w in mats[1:]}) != 1:  # one setting for O, gate/up and down
            return f"layer {i}: O, gate/up and down on different terms"
    if len(activations) != 1:  # mixed settings: each matrix keeps its own on the Python path
        return "matrices of several activations settings"
    layouts = {t for layer in layers for w in _layer_matrices(layer) for t in _layouts(w)}
    if layouts & set(HALF_LAYOUTS):
        return "f16 / bf16 matrices (the stack runs the q4 / q8 / s16 layouts)"
    if any(w.parts for layer in layers for w in _layer_matrices(layer)[1:]):
        return "row parts outside QKV"
    s16 = "s16" in layouts
    if s16 and activations & {"float32", "mixed-bf16"}:  # s16 runs those as a dense GEMM / two terms in Python
        return "s16 matrices under float32 or mixed-bf16 activations"
    return None


class LayerStack:
    """Python face of ``_C_cpu.LayerStack`` for one ``DecoderForCausalLM``."""

    def __init__(self, native, released: bool = False):
        self._native = native
        # matrices that keep only their panels (release_packed) run here only
        # under the build the panels were made for; else the Python path (which
        # unpacks their arrays again)
        self._panel_layout = native_layout() if released else None
        self._bound = None  # the kv_caches list last handed to the C++ object
        self.activations = native.activations  # the packed linear's, as every layer's CpuPackedLinear

    @classmethod
    def for_model(cls, model) -> "LayerStack | None":
        """The stack for ``model`` (anything with ``decoder_stack()``), or None
        where it declines (``decline_reason``)."""
        if decline_reason(model) is not None:
            return None
        from paged import _C_cpu

        spec = model.decoder_stack()
        layers = spec.layers
        backend = _own_backend(layers[0].attn_backend)
        native = _C_cpu.LayerStack(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size,
                                   spec.intermediate_size, spec.rms_norm_eps, backend.scale, backend.sliding_window,
                                   dl(spec.final_norm), layers[0].qkv.activations)
        released = False
        for layer in layers:
            bias = None if layer.qkv_bias is None else dl(layer.qkv_bias)
            mats = _layer_matrices(layer)
            released |= any(p.packed_released for w in mats for p in w.row_groups)  # all packed: decline_reason
            moe = getattr(layer, "moe", None) is not None
            mlp = (None, None) if moe else (_matrix(layer.gate_up), _matrix(layer.down))
            experts = _native_moe(model, layer) if moe else None
            panels = _panels(mats)
            native.add_layer(dl(layer.input_norm), dl(layer.post_norm),
                             _row_parts(layer.qkv), bias, _matrix(layer.o_proj), *mlp,
                             panels + [None] * (4 - len(panels)) if panels else [], layer.o_proj.one_term,
                             qkv_part_panels=_part_panels(layer.qkv), mlp=_python_mlp(model, layer) if moe else None,
                             moe=experts,
                             **_layer_shape(layer))
        return cls(native, released)

    @staticmethod
    def accepts(ops) -> bool:
        """Whether the model's current layer ops are the fused CPU ops, whose
        rotary inputs (int64 positions, float32 cos/sin table) the stack takes
        (benchmarks swap in torch's ops to compare)."""
        return isinstance(ops, CpuFusedLayerOps)

    def handles(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` runs here (switch on; with float32
        activations, fewer rows than the Python path's dense GEMM takes)."""
        dense_rows = packed_linear.DENSE_ROWS
        packed_rows = self.activations != "float32" or dense_rows <= 0 or num_tokens < dense_rows
        same_panels = self._panel_layout is None or self._panel_layout == native_layout()
        return packed_rows and same_panels and enabled()

    def run(self, hidden: torch.Tensor, rope_in, kv_caches, meta) -> torch.Tensor:
        """hidden [T, hidden] embedding rows (overwritten: they become the
        residual) -> the final normed hidden states [T, hidden]."""
        if kv_caches is not self._bound:  # the runner keeps one list: bound once, not per step
            # the native call checks the count against the layers (ValueError)
            self._native.bind_kv_caches([(dl(k), dl(v)) for k, v in kv_caches])
            self._bound = kv_caches
        # the positions are every table's; each layer rotates with its own table (bound at add_layer)
        positions, cos_sin = rope_in if isinstance(rope_in, tuple) else rope_in[0]
        out = torch.empty_like(hidden)
        self._native.run(dl(hidden), dl(out), dl(positions), dl(cos_sin),
                         dl(meta.slot_mapping), dl(meta.query_start_loc),
                         dl(meta.seq_lens), dl(meta.block_tables), int(meta.num_decodes),
                         -1 if meta.first_prompt_row is None else int(meta.first_prompt_row))
        return out
