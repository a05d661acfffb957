"""Building blocks shared by the Llama-family models: rotary embedding tables."""

from __future__ import annotations

import math

import torch


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
    """cos and signed-sin tables [max_positions, head_dim] computed once.

    Half rotation (HF Llama / neox): out = x * cos + cat(x2, x1) * sin_signed,
    where sin_signed = cat(-sin, sin), so one step costs a cat and an addcmul.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device, freq_factors: torch.Tensor | None = None):
        inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype).contiguous()
        self.sin = torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype).contiguous()
        self.half = head_dim // 2
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows for ``positions`` shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> rotated copy."""
        h = self.half
        rotated = torch.cat((x[..., h:], x[..., :h]), dim=-1)
        return torch.addcmul(x * cos, rotated, sin)
