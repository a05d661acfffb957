"""Model construction: ``build_model(config, weights, dtype, device, attn_backend)``."""

from __future__ import annotations

import torch

from paged.core.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from paged.core.models.decoder import DecoderForCausalLM, expected_weight_shapes

#: every family runs the one decoder, which executes the config's DecoderSpec
#: (core/models/spec.py); a family is a loader mapping (core/models/families/)
MODEL_CLASSES = {name: DecoderForCausalLM for name in SUPPORTED_ARCHITECTURES}
LlamaForCausalLM = DecoderForCausalLM


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, attn_backend, packed_linear=None, parallel=None) -> DecoderForCausalLM:
    """Instantiate the model for ``config.architecture`` from HF-named weights,
    cast to ``dtype`` on ``device``; attention runs through ``attn_backend``.
    ``packed_linear`` (optional) wraps weights kept packed by the loader (told
    each matrix's role, core/models/layers.py MatrixRole, when it has
    ``takes_role``); ``parallel`` (optional) is a tensor-parallel rank's
    collectives, with ``config`` and ``weights`` already its shard's."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(f"no model implementation for architecture {config.architecture!r} "
                         f"(supported: {', '.join(MODEL_CLASSES)})")
    missing = [n for n in expected_weight_shapes(config) if n not in weights]
    if missing:
        raise ValueError(f"weights are missing {len(missing)} tensors, e.g. {missing[0]!r}")
    return cls(config, weights, dtype, device, attn_backend, packed_linear, parallel)


__all__ = ["build_model", "MODEL_CLASSES", "DecoderForCausalLM", "LlamaForCausalLM"]
