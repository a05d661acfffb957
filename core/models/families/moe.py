"""Mixture-of-experts families: the Llama / Qwen layer with its MLP replaced
by experts (core/models/spec.py MoeSpec) on some or all layers.

- Mixtral: every layer, softmax over the experts, the top k renormalised;
  GGUF files call it ``llama`` (llama.cpp's converter) with ``expert_count``;
- Qwen3-MoE: Qwen3's Q/K norms, experts on the layers ``decoder_sparse_step``
  and ``mlp_only_layers`` leave sparse (the others dense at
  ``intermediate_size``), renormalised where ``norm_topk_prob``;
- Qwen2-MoE: Qwen2's Q/K/V bias, a shared expert scaled by a sigmoid gate
  beside the routed ones, not renormalised unless ``norm_topk_prob``.

GGUF files hold each layer's experts as 3-D tensors (``ffn_*_exps``), which
the loader splits into one matrix per expert; llama.cpp runs every layer of
``qwen2moe`` / ``qwen3moe`` as experts, and renormalises Mixtral's and
Qwen3-MoE's top k (Qwen2-MoE's not) unless ``expert_weights_norm`` says.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from paged.core.models.families import llama
from paged.core.models.families.base import Family, GgufFacts, Sizes
from paged.core.models.spec import DecoderSpec, MoeSpec

#: llama.cpp's expert_gating_func values
_GGUF_SCORING = {1: "softmax", 2: "sigmoid"}


def with_experts(spec: DecoderSpec, moe: MoeSpec, sparse: list[bool]) -> DecoderSpec:
    """``spec`` with the layers ``sparse`` marks running ``moe`` as their MLP."""
    return spec.with_layers(replace(layer, moe=moe) if s else layer for layer, s in zip(spec.layers, sparse))


def hf_sparse_layers(cfg: dict[str, Any], num_layers: int) -> list[bool]:
    """Qwen-MoE's choice of expert layers: every ``decoder_sparse_step``-th
    (counting from 1) but ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def gguf_moe(facts: GgufFacts, width_key: str, normalize: bool, shared: bool = False) -> MoeSpec:
    """The MoeSpec of a GGUF file's ``expert_*`` metadata."""
    func = facts.get("expert_gating_func", 1)
    if func not in _GGUF_SCORING:
        raise ValueError(f"expert_gating_func: expected 1 (softmax) or 2 (sigmoid), got {func!r}")
    return MoeSpec(facts.count("expert_count"), facts.count("expert_used_count"), facts.count(width_key),
                   _GGUF_SCORING[func], bool(facts.get("expert_weights_norm", normalize)),
                   facts.count("expert_shared_feed_forward_length") if shared else 0, shared)


# -- Mixtral -----------------------------------------------------------------

def mixtral_from_hf(cfg: dict[str, Any], sizes: Sizes) -> DecoderSpec:
    moe = MoeSpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]))
    return with_experts(llama.from_hf(cfg, sizes, window_always=True), moe, [True] * sizes.num_layers)


def mixtral_from_gguf(facts: GgufFacts, sizes: Sizes) -> DecoderSpec:
    return with_experts(llama.from_gguf(facts, sizes), gguf_moe(facts, "feed_forward_length", True),
                        [True] * sizes.num_layers)


_MIXTRAL_HF = re.compile(r"^block_sparse_moe\.(?:experts\.(\d+)\.(w1|w2|w3)|(gate))$")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_hf_rename(name: str) -> str:
    """Mixtral's ``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2`` and
    ``block_sparse_moe.gate`` -> paged's ``mlp.experts.e.gate_proj`` /
    ``up_proj`` / ``down_proj`` and ``mlp.gate``."""
    m = _MIXTRAL_HF.match(name)
    if m is None:
        return name
    return "mlp.gate" if m.group(3) else f"mlp.experts.{m.group(1)}.{_MIXTRAL_PARTS[m.group(2)]}"


def _gguf_has_experts(meta: dict[str, Any]) -> bool:
    return bool(meta.get("llama.expert_count"))


# -- Qwen3-MoE and Qwen2-MoE ---------------------------------------------------

def qwen_moe_from_hf(cfg: dict[str, Any], sizes: Sizes, qwen3: bool) -> DecoderSpec:
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    # checkpoints say num_experts; transformers >= 5 writes num_local_experts for Qwen3-MoE
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    moe = MoeSpec(int(experts), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                  normalize=bool(cfg.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                  shared_gate=bool(shared))
    base = (llama.from_hf(cfg, sizes, qk_norm=True) if qwen3 else
            llama.from_hf(cfg, sizes, qkv_bias=bool(cfg.get("qkv_bias", True))))
    return with_experts(base, moe, hf_sparse_layers(cfg, sizes.num_layers))


def qwen3_moe_from_gguf(facts: GgufFacts, sizes: Sizes) -> DecoderSpec:
    return with_experts(llama.from_gguf(facts, sizes, qk_norm=True),
                        gguf_moe(facts, "expert_feed_forward_length", True), [True] * sizes.num_layers)


def qwen2_moe_from_gguf(facts: GgufFacts, sizes: Sizes) -> DecoderSpec:
    shared = facts.has("blk.0.ffn_up_shexp.weight")
    return with_experts(llama.from_gguf(facts, sizes), gguf_moe(facts, "expert_feed_forward_length", False, shared),
                        [True] * sizes.num_layers)


MIXTRAL = Family("mixtral", ("llama",), ("MixtralForCausalLM", "mixtral"), mixtral_from_hf, mixtral_from_gguf,
                 gguf_permuted_qk=True, hf_rename=mixtral_hf_rename, gguf_when=_gguf_has_experts)
QWEN3_MOE = Family("qwen3moe", ("qwen3moe",), ("Qwen3MoeForCausalLM", "qwen3_moe"),
                   lambda cfg, s: qwen_moe_from_hf(cfg, s, True), qwen3_moe_from_gguf)
QWEN2_MOE = Family("qwen2moe", ("qwen2moe",), ("Qwen2MoeForCausalLM", "qwen2_moe"),
                   lambda cfg, s: qwen_moe_from_hf(cfg, s, False), qwen2_moe_from_gguf)
