"""Gemma 3 (text): four RMSNorms per layer whose weights scale by (1 + w)
(HF checkpoints store w; GGUF files store 1 + w already), per-head Q/K
norms, attention scale query_pre_attn_scalar ** -0.5, a GELU-tanh gated MLP,
embedding rows x sqrt(hidden) in the model dtype, and local sliding-window
layers (five per global one by default) with a RoPE base of their own."""

from __future__ import annotations

import math
from typing import Any

from paged.core.models.families.base import Family, GgufFacts, Sizes, gguf_eps, gguf_rope_scaling, hf_rope
from paged.core.models.spec import AttentionSpec, DecoderSpec, LayerSpec, MlpSpec, NormSpec, RopeSpec

#: Gemma's ``sliding_window_pattern`` when a file does not say: every 6th layer is global
DEFAULT_PATTERN = 6
#: llama.cpp's RoPE base for local layers when a GGUF file does not say
DEFAULT_LOCAL_THETA = 10000.0
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def gemma3_decoder(sizes: Sizes, eps: float, offset: float, scale: float, local: list[bool], window: int,
                   local_rope: RopeSpec, global_rope: RopeSpec, softcap: float | None, tie: bool,
                   activation: str = "gelu_tanh") -> DecoderSpec:
    norm = NormSpec("rms", eps, offset)
    mlp = MlpSpec(activation)

    def layer(is_local: bool) -> LayerSpec:
        att = AttentionSpec(local_rope if is_local else global_rope, qk_norm=norm, scale=scale,
                            sliding_window=window if is_local else 0)
        return LayerSpec(norm, norm, att, mlp, attn_post_norm=norm, mlp_post_norm=norm)

    kinds = {True: layer(True), False: layer(False)}
    return DecoderSpec(tuple(kinds[x] for x in local), final_norm=norm, embed_scale=math.sqrt(sizes.hidden_size),
                       final_logit_softcap=softcap, tie_word_embeddings=tie)


def _pattern(pattern, num_layers: int) -> list[bool]:
    """Which layers are local: every ``pattern``-th layer is global (an int),
    or one flag per layer (a list, True = local)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern: expected {num_layers} flags, got {len(pattern)}")
        return [bool(x) for x in pattern]
    return [bool((i + 1) % int(pattern)) for i in range(num_layers)]


def from_hf(cfg: dict[str, Any], sizes: Sizes) -> DecoderSpec:
    types = cfg.get("layer_types")
    local = ([t == "sliding_attention" for t in types] if types else
             _pattern(cfg.get("sliding_window_pattern", DEFAULT_PATTERN), sizes.num_layers))
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):  # transformers >= 5: one set per layer type
        g, lo = hf_rope(cfg, "full_attention", 1e6), hf_rope(cfg, "sliding_attention", DEFAULT_LOCAL_THETA)
        global_rope, local_rope = RopeSpec(g["theta"], g["scaling"]), RopeSpec(lo["theta"], lo["scaling"])
    else:  # rope_theta / rope_scaling are the global layers', rope_local_base_freq the local ones'
        g = hf_rope(cfg, None, 1e6)
        global_rope = RopeSpec(g["theta"], g["scaling"])
        local_rope = RopeSpec(float(cfg.get("rope_local_base_freq", DEFAULT_LOCAL_THETA)))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation: expected one of {', '.join(_ACTIVATIONS)}, got {act!r}")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping: expected none (Gemma 3 has none), "
                         f"got {cfg['attn_logit_softcapping']}")
    return gemma3_decoder(sizes, float(cfg.get("rms_norm_eps", 1e-6)), 1.0,
                          float(cfg.get("query_pre_attn_scalar", sizes.head_dim)) ** -0.5, local,
                          int(cfg.get("sliding_window") or 0), local_rope, global_rope,
                          cfg.get("final_logit_softcapping"), bool(cfg.get("tie_word_embeddings", True)),
                          _ACTIVATIONS[act])


def from_gguf(facts: GgufFacts, sizes: Sizes) -> DecoderSpec:
    local = _pattern(facts.get("attention.sliding_window_pattern", DEFAULT_PATTERN), sizes.num_layers)
    # llama.cpp derives the scale: 1/sqrt(head_dim), but hidden/heads for the 27B (62 layers)
    default = (sizes.hidden_size / sizes.num_heads if sizes.num_layers == 62 else sizes.head_dim) ** -0.5
    scale = float(facts.get("attention.scale", default))
    global_rope = RopeSpec(float(facts.get("rope.freq_base", 1e6)), gguf_rope_scaling(facts))
    local_rope = RopeSpec(float(facts.get("rope.freq_base_swa", DEFAULT_LOCAL_THETA)))
    softcap = facts.get("final_logit_softcapping", None)
    return gemma3_decoder(sizes, gguf_eps(facts, 1e-6), 0.0, scale, local, facts.count("attention.sliding_window"),
                          local_rope, global_rope, None if softcap is None else float(softcap),
                          not facts.has("output.weight"))


GEMMA3 = Family("gemma3", ("gemma3",), ("Gemma3ForCausalLM", "gemma3_text"), from_hf, from_gguf,
                hf_renames={"post_attention_layernorm": "self_attn.output_norm",
                            "pre_feedforward_layernorm": "post_attention_layernorm",
                            "post_feedforward_layernorm": "mlp.output_norm"})
