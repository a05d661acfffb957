"""Building blocks shared by the Llama-family models: the matmul dispatch,
rotary embedding tables and the elementwise ops of a layer (torch ops on any
device, fused C++ kernels of paged._C_cpu on the CPU)."""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. ``weight`` is a dense tensor, or a packed
    (quantized) weight object that brings its own ``linear(x, bias)``."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight.linear(x, bias)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with the model's rope scaling.

    Supported ``rope_type``: default/None, linear, llama3 (HF parameters) and
    freq_factors (llama.cpp's precomputed ``rope_freqs`` tensor, which encodes
    llama3 scaling in GGUF files).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        if freq_factors is None or freq_factors.numel() != inv_freq.numel():
            raise ValueError("rope_type 'freq_factors' needs a rope_freqs tensor of "
                             f"{inv_freq.numel()} values")
        return inv_freq / freq_factors.float().reshape(-1)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones
    kept, a smooth blend in between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    """Rotary tables over [max_positions] computed once, on first use, in the
    form the chosen ops need (``LayerOps``):

    - ``cos`` / ``sin`` [max_positions, head_dim] in the model dtype for the
      torch path. Half rotation (HF Llama / neox): out = x * cos + cat(x2, x1)
      * sin_signed, where sin_signed = cat(-sin, sin), so one step costs a cat
      and an addcmul.
    - ``cos_sin_cache`` float32 [max_positions, head_dim] = cat(cos, sin) of
      the half angles, for the fused CPU kernel.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device, freq_factors: torch.Tensor | None = None):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        self.dtype, self.device = dtype, device
        self.half = head_dim // 2
        self.max_positions = max_positions

    def _angles(self) -> torch.Tensor:
        return torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq)

    @functools.cached_property
    def cos(self) -> torch.Tensor:
        cos = self._angles().cos()
        return torch.cat((cos, cos), dim=-1).to(device=self.device, dtype=self.dtype).contiguous()

    @functools.cached_property
    def sin(self) -> torch.Tensor:
        sin = self._angles().sin()
        return torch.cat((-sin, sin), dim=-1).to(device=self.device, dtype=self.dtype).contiguous()

    @functools.cached_property
    def cos_sin_cache(self) -> torch.Tensor:
        angles = self._angles()
        return torch.cat((angles.cos(), angles.sin()), dim=-1).to(self.device).contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for ``positions`` shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> rotated copy."""
        h = self.half
        rotated = torch.cat((x[..., h:], x[..., :h]), dim=-1)
        return torch.addcmul(x * cos, rotated, sin)


class TorchLayerOps:
    """The elementwise part of a decoder layer as torch ops (any device).

    Convention shared with ``CpuFusedLayerOps``: callers use only the returned
    tensors; the fused version may have updated its inputs in place.
    """

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rms_norm(x + residual) * weight, x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def rope_inputs(self, rope: RotaryTable, positions: torch.Tensor):
        """Per-step rotary inputs, shared by every layer."""
        return rope.lookup(positions)

    def rope_split_qkv(self, qkv: torch.Tensor, rope: RotaryTable, rope_in, num_heads: int,
                       num_kv_heads: int, head_dim: int):
        """Fused qkv rows [T, (H + 2 Hkv) * D] -> contiguous q [T, H, D] and
        k, v [T, Hkv, D], with q and k rotated."""
        t, qk = qkv.shape[0], (num_heads + num_kv_heads) * head_dim
        cos, sin = rope_in
        rotated = rope.apply(qkv[:, :qk].view(t, num_heads + num_kv_heads, head_dim), cos, sin)
        return (rotated[:, :num_heads].contiguous(), rotated[:, num_heads:].contiguous(),
                qkv[:, qk:].view(t, num_kv_heads, head_dim).contiguous())


class CpuFusedLayerOps(TorchLayerOps):
    """The same ops as single C++ passes (paged._C_cpu, csrc_cpu/ops) on CPU
    tensors of float32 / bfloat16. ``add_rms_norm`` and the rotation work in
    place (x becomes the normed rows, residual the sum; qkv is rotated).

    Tensors cross as DLPack capsules (``to_dlpack``): handing nanobind the
    tensor itself goes through torch's Python-level ``__dlpack__`` and costs
    ~8 us per tensor, more than the kernels at decode sizes. The C++ side
    checks the capsules' dtype, shape and contiguity as usual.
    """

    name = "cpu-fused"

    def __init__(self, ops_module):
        self._C = ops_module

    def rms_norm(self, x, weight, eps):
        out = torch.empty_like(x)
        self._C.rms_norm(to_dlpack(out), to_dlpack(x), to_dlpack(weight), eps)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        self._C.fused_add_rms_norm(to_dlpack(x), to_dlpack(residual), to_dlpack(weight), eps)
        return x, residual

    def silu_and_mul(self, gate_up):
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._C.silu_and_mul(to_dlpack(out), to_dlpack(gate_up))
        return out

    def rope_inputs(self, rope, positions):
        return positions.to(torch.int64).contiguous(), rope.cos_sin_cache

    def rope_split_qkv(self, qkv, rope, rope_in, num_heads, num_kv_heads, head_dim):
        positions, cos_sin = rope_in
        self._C.rotary_embedding(to_dlpack(positions), to_dlpack(qkv), to_dlpack(cos_sin),
                                 num_heads, num_kv_heads, head_dim)
        t = qkv.shape[0]
        q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
        k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
        v = torch.empty_like(k)
        self._C.split_qkv(to_dlpack(qkv), to_dlpack(q), to_dlpack(k), to_dlpack(v))
        return q, k, v


def layer_ops(device: torch.device | str, dtype: torch.dtype) -> TorchLayerOps:
    """The fused CPU ops where they apply (a CPU model in float32/bfloat16 and
    a built extension; ``PAGED_FUSED_OPS=0`` turns them off), else torch's."""
    if (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and os.environ.get("PAGED_FUSED_OPS", "1") != "0"):
        try:
            from paged import _C_cpu
        except ImportError:
            return TorchLayerOps()
        if hasattr(_C_cpu, "fused_add_rms_norm"):
            return CpuFusedLayerOps(_C_cpu)
    return TorchLayerOps()
