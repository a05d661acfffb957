"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama layer with Q/K/V and gate/up
fused in the file (split by the loader), LongRoPE (short and long factor
sets, an attention factor on cos/sin) and Phi-4-mini's partial rotary
(3/4 of each head)."""

from __future__ import annotations

from typing import Any

from paged.core.models.families.base import (Family, GgufFacts, Sizes, gguf_eps, gguf_rope_scaling,
                                             gguf_rotary_dim, hf_rope, hf_rotary_dim, hf_windows)
from paged.core.models.families.llama import llama_decoder
from paged.core.models.spec import DecoderSpec


def _longrope(scaling: dict | None) -> dict | None:
    """HF's old name for LongRoPE ("su") as "longrope"."""
    if scaling and (scaling.get("rope_type") or scaling.get("type")) == "su":
        scaling = {**scaling, "rope_type": "longrope"}
    return scaling


def from_hf(cfg: dict[str, Any], sizes: Sizes) -> DecoderSpec:
    rope = hf_rope(cfg)
    return llama_decoder(sizes, float(cfg.get("rms_norm_eps", 1e-5)), rope["theta"], _longrope(rope["scaling"]),
                         hf_rotary_dim(rope["partial"], sizes.head_dim), False,
                         hf_windows(cfg, sizes.num_layers, always=True),
                         bool(cfg.get("tie_word_embeddings", False)))


def from_gguf(facts: GgufFacts, sizes: Sizes) -> DecoderSpec:
    scaling = gguf_rope_scaling(facts)
    if facts.has("rope_factors_long.weight"):
        scaling = {"rope_type": "longrope", "long_factor": facts.floats("rope_factors_long.weight"),
                   "short_factor": facts.floats("rope_factors_short.weight"),
                   "original_max_position_embeddings": facts.count("rope.scaling.original_context_length"),
                   "attention_factor": float(facts.get("rope.scaling.attn_factor", 1.0))}
    window = int(facts.get("attention.sliding_window", 0) or 0)  # 0: none (Phi-4)
    return llama_decoder(sizes, gguf_eps(facts), float(facts.get("rope.freq_base", 10000.0)), scaling,
                         gguf_rotary_dim(facts, sizes.head_dim), facts.has("blk.0.attn_q.bias"),
                         [window] * sizes.num_layers, not facts.has("output.weight"))


PHI3 = Family("phi3", ("phi3",), ("Phi3ForCausalLM", "phi3"), from_hf, from_gguf,
              gguf_renames={"ffn_up": "mlp.gate_up_proj"})  # llama.cpp keeps Phi-3's gate and up fused in ffn_up
