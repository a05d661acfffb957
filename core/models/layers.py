"""Building blocks shared by every decoder family: the matmul dispatch and
the roles of matrices, rotary embedding tables and the elementwise ops of a
layer as torch ops (any device). A platform's Worker may hand the model
faster ops with the same interface (``TorchLayerOps``), e.g.
backends/cpu/layer_ops.py; the model never asks which device it is on."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.core.models.spec import MlpSpec, RopeSpec, rope_kind

#: what a matrix does in the model (``MatrixRole.kind``)
MATRIX_KINDS = ("qkv", "o_proj", "gate_up", "down", "lm_head", "embed")


@dataclass(frozen=True)
class MatrixRole:
    """What one weight matrix is, handed to the platform's packed-weight
    factory when it is made (a factory with ``takes_role = True``), so a
    platform's precision plan can choose its arithmetic once, at
    construction: ``kind`` one of MATRIX_KINDS (``qkv``: the K/V projection,
    whose outputs the cache keeps), ``layer`` its decoder layer (None for
    the LM head and the embedding) of ``num_layers``."""

    kind: str
    layer: int | None = None
    num_layers: int = 0

    @property
    def kv_projection(self) -> bool:
        return self.kind == "qkv"


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
           first_prompt_row: int | None = None) -> torch.Tensor:
    """x @ weight.T + bias. ``weight`` is a dense tensor, or a packed
    (quantized) weight object that brings its own ``linear(x, bias)``.
    ``first_prompt_row`` is a fact about the rows (from there on they are
    prompt rows, whose next token is known; AttentionMetadata's), handed to
    packed weights, whose arithmetic for such rows their platform chose when
    it made them; None says nothing about the rows."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if first_prompt_row is None:
        return weight.linear(x, bias)
    return weight.linear(x, bias, first_prompt_row=first_prompt_row)


def mlp_activation(ops: "TorchLayerOps", gate_up: torch.Tensor, mlp: MlpSpec) -> torch.Tensor:
    """An MLP's activation of its gate/up rows (gated: act(gate) * up, else
    act(up)), by the layer ops (a platform's fused passes where it has them)."""
    if not mlp.gated:
        return ops.activation(gate_up, mlp.activation)
    if mlp.activation == "silu":
        return ops.silu_and_mul(gate_up)
    return ops.gelu_tanh_and_mul(gate_up)


def embedding_rows(ids: torch.Tensor, table) -> torch.Tensor:
    """Rows ``ids`` of an embedding table: a dense tensor, or a packed weight
    object that dequantizes only the rows asked for (``embedding(ids)``)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(ids, table)
    return table.embedding(ids)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with the model's rope
    scaling (``head_dim``: the rotary dimension, all of the head or part of it).

    Supported ``rope_type``: default/None, linear, llama3 (HF parameters),
    freq_factors (llama.cpp's precomputed ``rope_freqs`` tensor, which encodes
    llama3 scaling in GGUF files) and longrope (Phi-3's per-frequency
    factors; ``longrope_factors`` says which set).
    """
    kind = rope_kind(scaling)
    if kind == "longrope":  # HF: 1 / (factor * base ** (2i / d)), in this order
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        factors = torch.tensor(longrope_factors(scaling), dtype=torch.float32)
        if factors.numel() != shape.numel():
            raise ValueError(f"longrope factors: expected {shape.numel()} values, got {factors.numel()}")
        return 1.0 / (factors * theta ** shape)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope)")


def longrope_factors(scaling: dict) -> list[float]:
    """The factor set a LongRoPE model rotates every position with: the
    short factors (HF's below original_max_position_embeddings), or the
    long ones when ``PAGED_LONGROPE=long``. HF switches a whole sequence to
    the long set once it grows past the original length, which rotates
    every earlier key anew; a KV cache keeps keys rotated once, so paged
    keeps one set for all positions (docs/models.md, "LongRoPE")."""
    import os

    which = os.environ.get("PAGED_LONGROPE", "short")
    if which not in ("short", "long"):
        raise ValueError(f"PAGED_LONGROPE: expected 'short' or 'long', got {which!r}")
    return [float(f) for f in scaling[f"{which}_factor"]]


def rope_attention_factor(scaling: dict | None, max_positions: int) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor
    (HF's default sqrt(1 + ln(s) / ln(original)) for s = max positions /
    original, or the checkpoint's own), 1 otherwise."""
    if rope_kind(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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
    form the chosen ops need (``TorchLayerOps`` or a platform's). The first
    ``rotary_dim`` dimensions of each head rotate (default: all of
    ``head_dim``; Phi-4-mini rotates 3/4), the rest pass through:

    - ``cos`` / ``sin`` [max_positions, rotary_dim] in the model dtype for
      the torch path. Half rotation (HF Llama / neox): out = x * cos +
      cat(x2, x1) * sin_signed, where sin_signed = cat(-sin, sin), so one
      step costs a cat and an addcmul.
    - ``cos_sin_cache`` float32 [max_positions, rotary_dim] = cat(cos, sin)
      of the half angles, for fused kernels (the CPU's, which rotate each
      head's first rotary_dim dims: the table's width).

    LongRoPE's attention factor multiplies cos and sin in both forms, as HF does.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device, freq_factors: torch.Tensor | None = None,
                 rotary_dim: int | None = None):
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even number in (0, head_dim = {head_dim}], "
                             f"got {self.rotary_dim}")
        self.inv_freq = rope_inv_freq(self.rotary_dim, theta, scaling, freq_factors)
        self.attention_factor = rope_attention_factor(scaling, max_positions)
        self.dtype, self.device = dtype, device
        self.half = self.rotary_dim // 2
        self.max_positions = max_positions

    @classmethod
    def for_spec(cls, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device, freq_factors: torch.Tensor | None = None) -> "RotaryTable":
        return cls(head_dim, max_positions, rope.theta, rope.scaling, dtype, device, freq_factors,
                   rope.dim(head_dim))

    @property
    def partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def _angles(self) -> torch.Tensor:
        return torch.outer(torch.arange(self.max_positions, dtype=torch.float32), self.inv_freq)

    def _scaled(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.attention_factor == 1.0 else t * self.attention_factor

    @functools.cached_property
    def cos(self) -> torch.Tensor:
        cos = self._scaled(self._angles().cos())
        return torch.cat((cos, cos), dim=-1).to(device=self.device, dtype=self.dtype).contiguous()

    @functools.cached_property
    def sin(self) -> torch.Tensor:
        sin = self._scaled(self._angles().sin())
        return torch.cat((-sin, sin), dim=-1).to(device=self.device, dtype=self.dtype).contiguous()

    @functools.cached_property
    def cos_sin_cache(self) -> torch.Tensor:
        angles = self._angles()
        return torch.cat((self._scaled(angles.cos()), self._scaled(angles.sin())), dim=-1).to(self.device).contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for ``positions`` shaped [T, 1, rotary_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> rotated copy (the first rotary_dim of each head)."""
        h = self.half
        if self.partial:
            r = self.rotary_dim
            return torch.cat((self.apply_full(x[..., :r], cos, sin, h), x[..., r:]), dim=-1)
        return self.apply_full(x, cos, sin, h)

    @staticmethod
    def apply_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int) -> torch.Tensor:
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

    def gather_inputs(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """A sharded model's slices of an output projection's input features
        (``part``: "experts" for every expert's activations at once) -> all
        of them; here ``x`` is already whole."""
        return x

    def gather_outputs(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's output rows (hidden columns) of a projection -> every
        column; here ``y`` is already whole."""
        return y

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

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU with the tanh approximation (HF's gelu_pytorch_tanh) of the
        gate times up (Gemma's MLP)."""
        inter = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]

    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """An ungated MLP's activation ("silu" or "gelu_tanh")."""
        return F.silu(x) if kind == "silu" else F.gelu(x, approximate="tanh")

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (layer_norm(x + residual), x + residual)."""
        residual = x + residual
        return self.layer_norm(residual, weight, bias, eps), residual

    def qk_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                num_kv_heads: int, head_dim: int, eps: float) -> torch.Tensor:
        """RMSNorm of every Q and K head (weights [head_dim]) of fused qkv
        rows [T, (H + 2 Hkv) * D], before the rotation (Qwen3, Gemma 3);
        V is untouched. Returns the rows (normed in place)."""
        t, qd, kd = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :qd].view(t, num_heads, head_dim)
        k = qkv[:, qd:qd + kd].view(t, num_kv_heads, head_dim)
        qkv[:, :qd] = F.rms_norm(q, (head_dim,), q_weight, eps).view(t, qd)
        qkv[:, qd:qd + kd] = F.rms_norm(k, (head_dim,), k_weight, eps).view(t, kd)
        return qkv

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
