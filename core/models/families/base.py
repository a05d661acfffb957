"""What a family mapping is, and the pieces every mapping shares.

A ``Family`` says which GGUF ``general.architecture`` and HF
``architectures`` / ``model_type`` names it answers to, builds the
DecoderSpec (core/models/spec.py) from a GGUF file's metadata or an HF
config.json, and renames the tensors that its files name differently from
paged's HF-Llama names (``gguf_renames`` / ``hf_renames``, per layer). The
loaders do the rest the same way for every family: sizes, tokens, the
uniform GGUF tensor names, fused tensors split into their parts
(``self_attn.qkv_proj`` -> q/k/v, ``mlp.gate_up_proj`` -> gate/up), and the
shape check against the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from paged.core.models.spec import DecoderSpec


@dataclass(frozen=True)
class Sizes:
    """The counts a family's mapping may need (a model's shape)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


class GgufFacts:
    """What a family reads from a GGUF file: ``get(key, default)`` /
    ``count(key, default)`` of its ``<arch>.*`` metadata, which tensors the
    file holds (``has``), and a small tensor's values (``floats``: rope
    factors)."""

    def __init__(self, metadata, tensor_names: set[str], read_floats: Callable[[str], list[float]]):
        self.metadata = metadata  # gguf_loader's _ArchMetadata
        self.get, self.count = metadata.get, metadata.count
        self._names, self._read = tensor_names, read_floats

    def has(self, name: str) -> bool:
        return name in self._names

    def floats(self, name: str) -> list[float]:
        return self._read(name)


@dataclass(frozen=True)
class Family:
    """One family's mapping (see the module docstring). ``from_hf(cfg,
    sizes)`` / ``from_gguf(facts, sizes)`` build the DecoderSpec;
    ``gguf_permuted_qk``: llama.cpp's converter interleaved each Q/K head's
    rotary halves (the loader undoes it); ``hf_rename``: a layer tensor
    name (after ``model.layers.i.``) -> paged's, for names a dict cannot
    list (one per expert); ``gguf_when``: the family takes a file of its
    architecture only where this says so of the metadata (Mixtral: a
    ``llama`` file with experts)."""

    name: str
    gguf_archs: tuple[str, ...]
    hf_names: tuple[str, ...]
    from_hf: Callable[[dict[str, Any], Sizes], DecoderSpec]
    from_gguf: Callable[[GgufFacts, Sizes], DecoderSpec]
    gguf_renames: dict[str, str] = field(default_factory=dict)
    hf_renames: dict[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False
    hf_rename: Callable[[str], str] | None = None
    gguf_when: Callable[[dict[str, Any]], bool] | None = None


# -- HF config.json ----------------------------------------------------------

def hf_rope(cfg: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> dict[str, Any]:
    """The rope settings of ``layer_type`` (or the model's) from either
    config form: transformers >= 5 nests them in ``rope_parameters`` (per
    layer type where layers differ), older configs keep ``rope_theta`` and
    ``rope_scaling`` at the top. -> {"theta", "scaling", "partial"}."""
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    scaling = cfg.get("rope_scaling") or (params if (params.get("rope_type") or params.get("type") or "default")
                                          != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        # HF reads LongRoPE's original length from the top level in older configs
        if "original_max_position_embeddings" not in scaling and cfg.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = int(cfg["original_max_position_embeddings"])
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return {"theta": float(theta), "scaling": scaling, "partial": float(partial or 1.0)}


def hf_rotary_dim(partial: float, head_dim: int) -> int | None:
    """HF's int(head_dim * partial_rotary_factor); None for the whole head."""
    dim = int(head_dim * partial)
    return None if dim == head_dim else dim


def hf_windows(cfg: dict[str, Any], num_layers: int, always: bool = False) -> list[int]:
    """Each layer's sliding window from config.json: ``layer_types`` where
    given ("sliding_attention" layers take ``sliding_window``), else every
    layer when ``always`` (Mistral, Phi-3) or ``use_sliding_window`` says so."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types: expected {num_layers} entries, got {len(types)}")
        return [window if t == "sliding_attention" else 0 for t in types]
    on = always or bool(cfg.get("use_sliding_window"))
    return [window if on else 0] * num_layers


# -- GGUF metadata -----------------------------------------------------------

def gguf_rope_scaling(facts: GgufFacts) -> dict[str, Any] | None:
    """``rope.scaling.*`` as HF's rope_scaling dict; llama.cpp's precomputed
    llama3 factors (``rope_freqs``) as freq_factors."""
    if facts.has("rope_freqs.weight"):
        return {"rope_type": "freq_factors"}
    kind = facts.get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(facts.get("rope.scaling.factor", 1.0))}
    if facts.get("rope.scaling.original_context_length", None) is not None:
        scaling["original_max_position_embeddings"] = facts.count("rope.scaling.original_context_length")
    return scaling


def gguf_rotary_dim(facts: GgufFacts, head_dim: int) -> int | None:
    """``rope.dimension_count`` where it is less than the head (Phi-4-mini)."""
    dim = facts.get("rope.dimension_count", head_dim)
    return None if dim == head_dim else int(dim)


def gguf_eps(facts: GgufFacts, default: float = 1e-5) -> float:
    return float(facts.get("attention.layer_norm_rms_epsilon", default))
