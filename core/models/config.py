"""ModelConfig: the sizes, tokens and decoder description a model and its
loaders agree on.

The decoder itself is data (``decoder``: core/models/spec.py DecoderSpec),
built by the loaders' family mappings (core/models/families/). A config
made by hand with the flat Llama-family fields (``rms_norm_eps``,
``rope_theta``, ``rope_scaling``, ``qkv_bias``, ``sliding_window``,
``tie_word_embeddings``) and no ``decoder`` describes the Llama layer with
those options; with a ``decoder`` the flat fields are summaries of it (the
final norm's eps, the first layer's RoPE, the widest window), kept for the
code that reads one value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from paged.core.models.spec import DecoderSpec, llama_like

#: the families paged implements (HF ``architectures`` names and GGUF
#: ``general.architecture`` names map to one of these: core/models/families/)
SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    #: every token id that ends generation (eos_token_id first); HF
    #: generation_config may list several
    stop_token_ids: list[int] = field(default_factory=list)
    #: the decoder as data; None: the Llama layer with the flat fields above
    decoder: DecoderSpec | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.eos_token_id is not None and self.eos_token_id not in self.stop_token_ids:
            self.stop_token_ids = [self.eos_token_id, *self.stop_token_ids]
        d = self.decoder
        if d is not None:
            if d.num_layers != self.num_layers:
                raise ValueError(f"ModelConfig.decoder: expected {self.num_layers} layers, got {d.num_layers}")
            first = d.layers[0].attention
            self.rms_norm_eps = d.final_norm.eps
            self.rope_theta, self.rope_scaling = first.rope.theta, first.rope.scaling
            self.tie_word_embeddings = d.tie_word_embeddings
            self.qkv_bias = any(layer.attention.qkv_bias for layer in d.layers)
            self.sliding_window = d.widest_window() or None

    @property
    def spec(self) -> DecoderSpec:
        """The decoder description (``decoder``, or the Llama layer from the flat fields)."""
        if self.decoder is not None:
            return self.decoder
        return llama_like(self.num_layers, eps=self.rms_norm_eps, theta=self.rope_theta, scaling=self.rope_scaling,
                          qkv_bias=self.qkv_bias, sliding_window=self.sliding_window or 0,
                          tie_word_embeddings=self.tie_word_embeddings)


# -- dtype resolution -------------------------------------------------------

_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype, platform=None) -> torch.dtype:
    """``--dtype auto|float32|bfloat16|float16`` -> torch dtype.

    auto: the platform's default dtype (float32 on the CPU, docs/kernels.md
    "Choosing the CPU path"); float32 when no platform is given.
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower()
    if key == "auto":
        return platform.default_dtype() if platform is not None else torch.float32
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r} (choose auto, float32, bfloat16 or float16)")
    dtype = _DTYPE_NAMES[key]
    if platform is not None and dtype not in platform.supported_dtypes():
        raise ValueError(f"dtype {name!r} is not supported on platform {platform.name!r} "
                         f"(supported: {[str(d).removeprefix('torch.') for d in platform.supported_dtypes()]})")
    return dtype
