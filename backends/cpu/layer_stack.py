"""All decoder layers of a CPU step in one extension call (paged._C_cpu.LayerStack).

Batch-1 decode is bound by Python around the kernels: the Python path makes
~10 extension calls per layer, each with a DLPack capsule per tensor and a
torch allocation for its output. ``LayerStack`` runs the same kernels with the
same arguments in the same order from C++ (csrc_cpu/model/layer_stack.h), so
its hidden states and KV caches are bitwise those of the Python path, which
stays the fallback (and the tests' oracle).

The CPU worker attaches it to the model (backends/cpu/worker.py), which
describes itself through ``decoder_stack()``. Eligible models: CPU, float32,
the fused CPU layer ops (``accepts``), every layer's
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

import torch

from paged.backends.cpu.attention import CpuBackend, dl
from paged.backends.cpu import quant_linear as packed_linear
from paged.backends.cpu.layer_ops import CpuFusedLayerOps
from paged.backends.cpu.quant_linear import CpuPackedLinear

__all__ = ["LayerStack", "enabled"]


def enabled() -> bool:
    """False when ``PAGED_LAYER_STACK=0`` (benchmarks and debugging)."""
    return os.environ.get("PAGED_LAYER_STACK", "1") != "0"


def _matrix(w: CpuPackedLinear):
    return (w.qtype, dl(w.qs), dl(w.d), None if w.m is None else dl(w.m))


def _panels(mats) -> list:
    """Each matrix's persistent weight panels (None where off), the tensors
    its CpuPackedLinear passes, so both paths read the same bytes."""
    panels = [w.weight_panels() for w in mats]
    return [] if all(p is None for p in panels) else [None if p is None else dl(p) for p in panels]


def _dense_f32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"


class LayerStack:
    """Python face of ``_C_cpu.LayerStack`` for one ``LlamaForCausalLM``."""

    def __init__(self, native):
        self._native = native
        self._bound = None  # the kv_caches list last handed to the C++ object
        self.activations = native.activations  # the packed linear's, as every layer's CpuPackedLinear

    @classmethod
    def for_model(cls, model) -> "LayerStack | None":
        """The stack for ``model`` (anything with ``decoder_stack()``), or None
        when it is not eligible (see the module docstring)."""
        try:
            from paged import _C_cpu
        except ImportError:
            return None
        spec = model.decoder_stack()
        layers = spec.layers
        if (not hasattr(_C_cpu, "LayerStack") or not layers or spec.device.type != "cpu"
                or spec.dtype != torch.float32 or not _dense_f32(spec.final_norm)):
            return None
        backend = layers[0].attn_backend
        if type(backend) is not CpuBackend or backend.dtype != torch.float32:
            return None
        activations = set()
        for layer in layers:
            mats = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            packed = all(isinstance(w, CpuPackedLinear) for w in mats)
            if (not packed or layer.attn_backend is not backend or not _dense_f32(layer.input_norm)
                    or not _dense_f32(layer.post_norm)
                    or not (layer.qkv_bias is None or _dense_f32(layer.qkv_bias))):
                return None
            activations.update(w.activations for w in mats)
            if len({w.one_term for w in mats[1:]}) != 1:  # one setting for O, gate/up and down
                return None
        if len(activations) != 1:  # mixed settings: each matrix keeps its own on the Python path
            return None
        s16 = any(w.qtype == "s16" for layer in layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        if s16 and activations & {"float32", "mixed-bf16"}:  # s16 runs those as a dense GEMM / two terms in Python
            return None
        native = _C_cpu.LayerStack(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size,
                                   spec.intermediate_size, spec.rms_norm_eps, backend.scale, backend.sliding_window,
                                   dl(spec.final_norm), activations.pop())
        for layer in layers:
            bias = None if layer.qkv_bias is None else dl(layer.qkv_bias)
            mats = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            native.add_layer(dl(layer.input_norm), dl(layer.post_norm),
                             _matrix(layer.qkv), bias, _matrix(layer.o_proj), _matrix(layer.gate_up),
                             _matrix(layer.down), _panels(mats), layer.o_proj.one_term)
        return cls(native)

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
        return packed_rows and enabled()

    def run(self, hidden: torch.Tensor, rope_in, kv_caches, meta) -> torch.Tensor:
        """hidden [T, hidden] embedding rows (overwritten: they become the
        residual) -> the final normed hidden states [T, hidden]."""
        if kv_caches is not self._bound:  # the runner keeps one list: bound once, not per step
            # the native call checks the count against the layers (ValueError)
            self._native.bind_kv_caches([(dl(k), dl(v)) for k, v in kv_caches])
            self._bound = kv_caches
        positions, cos_sin = rope_in
        out = torch.empty_like(hidden)
        self._native.run(dl(hidden), dl(out), dl(positions), dl(cos_sin),
                         dl(meta.slot_mapping), dl(meta.query_start_loc),
                         dl(meta.seq_lens), dl(meta.block_tables), int(meta.num_decodes),
                         -1 if meta.first_prompt_row is None else int(meta.first_prompt_row))
        return out
