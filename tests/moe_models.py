"""Tiny random-weight mixture-of-experts models for tests/test_moe.py, built
as tests/family_models.py builds the dense families (its vocabularies,
tokenizer files and runners): a transformers config (Mixtral, Qwen3-MoE,
Qwen2-MoE with a gated shared expert) saved as an HF folder, and written to
GGUF the way llama.cpp's converter writes it, from the saved checkpoint:
each layer's experts stacked into 3-D ``ffn_*_exps`` tensors, the router
``ffn_gate_inp`` kept float32 (llama.cpp does not quantize it), Mixtral
as architecture ``llama`` with Q/K permuted, the ``expert_*`` metadata."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from family_models import CHATML, Family, _add_tokenizer, _permute, close_gguf, make_hf, open_gguf, quantized_copy
from gguf import GGMLQuantizationType as Q

FAMILIES = {
    "mixtral": Family("mixtral", "MixtralForCausalLM", "MixtralConfig", "llama", 2, dict(
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1e6),
        template=CHATML),
    "qwen3moe": Family("qwen3moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3moe", 2, dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, head_dim=32,
        rope_theta=1e6), pre="qwen2", template=CHATML),
    "qwen2moe": Family("qwen2moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "qwen2moe", 2, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        norm_topk_prob=False, rope_theta=1e6), pre="qwen2", template=CHATML),
}

#: the routers' weights x this (their init gives logits about 0.1 apart)
ROUTER_SCALE = 20.0

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """The saved HF checkpoint's tensors (one expert per tensor)."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def gguf_tensors(fam: Family, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint tensors -> llama.cpp's (float32): experts stacked per layer."""
    out, experts = {}, {}
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((int(m.group(1)), _PARTS[m.group(3)]), {})[int(m.group(2))] = w
            continue
        if name in _GLOBAL:
            out[_GLOBAL[name]] = w
            continue
        layer, rest, kind = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name).groups()
        g = f"blk.{layer}.{_LAYER[rest]}.{kind}"
        if fam.gguf_arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _permute(w, cfg.num_attention_heads if rest.endswith("q_proj") else cfg.num_key_value_heads)
        out[g] = w.reshape(-1) if rest == "mlp.shared_expert_gate" else w
    for (layer, part), per in experts.items():
        out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack([per[e] for e in range(len(per))])
    return out


def write_gguf(fam: Family, hf, folder: Path, path: Path, qtype: Q = Q.F32, **arch_keys) -> Path:
    """The GGUF file of the HF folder ``folder`` (of model ``hf``), matrices
    and experts at ``qtype`` (the router and vectors float32); ``arch_keys``:
    further ``<arch>.*`` metadata (uint32 values)."""
    cfg = hf.config
    w, head_dim = open_gguf(fam, cfg, path)
    moe_width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if fam.gguf_arch != "llama":
        w.add_expert_feed_forward_length(moe_width)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in arch_keys.items():
        w.add_uint32(f"{fam.gguf_arch}.{key}", value)
    _add_tokenizer(fam, w)
    close_gguf(w, gguf_tensors(fam, cfg, checkpoint(folder)), qtype, quantizes)  # float32 already
    return path


def quantizes(name: str, w: np.ndarray) -> bool:
    """Matrices and experts whose rows are whole blocks, but the router."""
    return w.ndim >= 2 and w.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name


def hf_on(hf, qtype: Q):
    """A copy of the HF model holding what a ``qtype`` file of it holds: each
    matrix and expert (transformers keeps them fused, [experts, rows, cols])
    quantized and dequantized row by row, the router and vectors as they are."""
    return quantized_copy(hf, qtype, lambda name, w: w.ndim >= 2 and w.shape[-1] % 32 == 0 and not name.endswith(
        ("mlp.gate.weight", "shared_expert_gate.weight")))


def build(name: str, folder: Path, seed: int = 0, **overrides):
    """(Family, HF model, {"hf", "f32", "q8_0": path}) of family ``name``."""
    fam = FAMILIES[name]
    hf = make_hf(fam, folder / "hf", seed, **overrides)
    with torch.no_grad():  # clear routing: the init's router barely prefers one expert, near-ties everywhere
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    hf.save_pretrained(folder / "hf")
    files = {"hf": folder / "hf", "f32": write_gguf(fam, hf, folder / "hf", folder / "f32.gguf"),
             "q8_0": write_gguf(fam, hf, folder / "hf", folder / "q8_0.gguf", Q.Q8_0)}
    return fam, hf, files
