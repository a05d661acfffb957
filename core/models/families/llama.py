"""Llama 2 / 3.x, SmolLM, Mistral, Qwen2 / 2.5 and Qwen3: the Llama layer
(RMSNorm before attention and MLP, SwiGLU, one RoPE), with a window per
layer, Qwen2's Q/K/V bias and Qwen3's per-head Q/K RMSNorm as options."""

from __future__ import annotations

from typing import Any

from paged.core.models.families.base import (Family, GgufFacts, Sizes, gguf_eps, gguf_rope_scaling,
                                             gguf_rotary_dim, hf_rope, hf_rotary_dim, hf_windows)
from paged.core.models.spec import AttentionSpec, DecoderSpec, LayerSpec, NormSpec, RopeSpec


def llama_decoder(sizes: Sizes, eps: float, theta: float, scaling: dict | None, rotary_dim: int | None,
                  qkv_bias: bool, windows: list[int], tie: bool, qk_norm: bool = False) -> DecoderSpec:
    """The Llama layer for every layer, each with its own window."""
    norm = NormSpec("rms", eps)
    rope = RopeSpec(theta, scaling, rotary_dim)
    layer = {w: LayerSpec(norm, norm, AttentionSpec(rope, qkv_bias, norm if qk_norm else None, None, w))
             for w in set(windows)}
    return DecoderSpec(tuple(layer[w] for w in windows), final_norm=norm, tie_word_embeddings=tie)


def from_hf(cfg: dict[str, Any], sizes: Sizes, *, qkv_bias: bool | None = None, qk_norm: bool = False,
            window_always: bool = False) -> DecoderSpec:
    rope = hf_rope(cfg)
    bias = bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias
    return llama_decoder(sizes, float(cfg.get("rms_norm_eps", 1e-6)), rope["theta"], rope["scaling"],
                         hf_rotary_dim(rope["partial"], sizes.head_dim), bias,
                         hf_windows(cfg, sizes.num_layers, always=window_always),
                         bool(cfg.get("tie_word_embeddings", False)), qk_norm)


def from_gguf(facts: GgufFacts, sizes: Sizes, *, qk_norm: bool = False) -> DecoderSpec:
    window = facts.get("attention.sliding_window", None)
    window = facts.count("attention.sliding_window") if window else 0
    return llama_decoder(sizes, gguf_eps(facts), float(facts.get("rope.freq_base", 10000.0)),
                         gguf_rope_scaling(facts), gguf_rotary_dim(facts, sizes.head_dim),
                         facts.has("blk.0.attn_q.bias"), [window] * sizes.num_layers,
                         not facts.has("output.weight"), qk_norm)


LLAMA = Family("llama", ("llama",), ("LlamaForCausalLM", "llama"), from_hf, from_gguf, gguf_permuted_qk=True)
MISTRAL = Family("mistral", ("mistral",), ("MistralForCausalLM", "mistral"),
                 lambda cfg, s: from_hf(cfg, s, window_always=True), from_gguf, gguf_permuted_qk=True)
QWEN2 = Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM", "qwen2"),
               lambda cfg, s: from_hf(cfg, s, qkv_bias=True), from_gguf)
QWEN3 = Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM", "qwen3"),
               lambda cfg, s: from_hf(cfg, s, qk_norm=True), lambda f, s: from_gguf(f, s, qk_norm=True))
