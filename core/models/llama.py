"""The Llama family's name for the one decoder every family runs
(core/models/decoder.py): a Llama layer is the DecoderSpec of
core/models/spec.py ``llama_like``, nothing of its own."""

from __future__ import annotations

from paged.core.models.decoder import (DecoderForCausalLM, DecoderLayer, DecoderLayerWeights, DecoderStack,
                                       expected_weight_shapes)
from paged.core.models.layers import linear  # noqa: F401 - benchmarks time the model's linears through it

LlamaForCausalLM = DecoderForCausalLM
LlamaDecoderLayer = DecoderLayer

__all__ = ["LlamaForCausalLM", "LlamaDecoderLayer", "DecoderLayerWeights", "DecoderStack", "expected_weight_shapes"]
