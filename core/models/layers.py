"""Building blocks shared by the Llama-family models: the matmul dispatch,
rotary embedding tables and the elementwise ops of a layer as torch ops (any
device). A platform's Worker may hand the model faster ops with the same
interface (``TorchLayerOps``), e.g. backends/cpu/layer_ops.py; the model
never asks which device it is on."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           first_prompt_row: int | None = None, kv_projection: bool = False) -> torch.Tensor:
    """x @ weight.T + bias. ``weight`` is a dense tensor, or a packed
    (quantized) weight object that brings its own ``linear(x, bias)``.
    ``first_prompt_row`` (rows from there on are prompt rows) goes to packed
    weights that take it, which may compute those rows more cheaply (the CPU's
    "mixed" activations), with ``kv_projection`` (the outputs are the K/V the
    cache keeps, read by every later token); None says nothing about the rows."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if first_prompt_row is None:
        return weight.linear(x, bias)
    return weight.linear(x, bias, first_prompt_row=first_prompt_row, kv_projection=kv_projection)


def embedding_rows(ids: torch.Tensor, table) -> torch.Tensor:
    """Rows ``ids`` of an embedding table: a dense tensor, or a packed weight
    object that dequantizes only the rows asked for (``embedding(ids)``)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.embedding(ids)


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
    form the chosen ops need (``TorchLayerOps`` or a platform's):

    - ``cos`` / ``sin`` [max_positions, head_dim] in the model dtype for the
      torch path. Half rotation (HF Llama / neox): out = x * cos + cat(x2, x1)
      * sin_signed, where sin_signed = cat(-sin, sin), so one step costs a cat
      and an addcmul.
    - ``cos_sin_cache`` float32 [max_positions, head_dim] = cat(cos, sin) of
      the half angles, for fused kernels (the CPU's).
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


class SingleDevice:
    """The points where tensor-parallel ranks meet, for a model that is not
    sharded: nothing to reduce or gather. A sharded model gets
    core/engine/distributed/parallel_ops.py's TensorParallelOps instead."""

    def output_projection(self, x: torch.Tensor, weight, part: str, **linear_options) -> torch.Tensor:
        """linear(x, weight) for a block's output projection (``part``:
        "attention" for o_proj, "mlp" for down). A sharded model's ``x``
        holds this rank's slice of the input features and ``weight`` its
        slice of the output rows; the result is the full output on every
        rank."""
        return linear(x, weight, **linear_options)

    def embed(self, input_ids: torch.Tensor, table) -> torch.Tensor:
        """Embedding rows of ``input_ids`` from this rank's vocab slice."""
        return embedding_rows(input_ids, table)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocab columns of the logits -> every column."""
        return logits


class TorchLayerOps:
    """The elementwise part of a decoder layer as torch ops (any device).

    The interface every platform's layer ops keep (the CPU's fused C++ ops in
    backends/cpu/layer_ops.py): callers use only the returned tensors, since
    a fused version may have updated its inputs in place.
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
