"""ModelConfig: the architecture facts a model and its loaders agree on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: architectures the Llama-family torch module implements (HF ``architectures``
#: names and GGUF ``general.architecture`` names both map to one of these)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


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
