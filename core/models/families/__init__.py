"""The families paged loads: each a mapping from its files' names and
metadata onto the one decoder description (core/models/spec.py), used by
both loaders (core/models/loaders/gguf_loader.py, hf_loader.py).

Adding a dense family: a ``Family`` in a module here, listed in FAMILIES,
plus a test (docs/adding-a-model.md); mixture-of-experts families live in
moe.py."""

from __future__ import annotations

from typing import Any

from paged.core.models.families.base import Family, GgufFacts, Sizes
from paged.core.models.families.gemma import GEMMA3
from paged.core.models.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from paged.core.models.families.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from paged.core.models.families.phi import PHI3

#: first match wins: Mixtral before Llama (the same GGUF architecture, with experts)
FAMILIES: tuple[Family, ...] = (MIXTRAL, LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, PHI3, QWEN3_MOE, QWEN2_MOE)


def gguf_family(arch: str | None, meta: dict[str, Any] | None = None) -> Family | None:
    """The family of a GGUF ``general.architecture`` (and its metadata,
    for families that share an architecture name), or None."""
    return next((f for f in FAMILIES if arch in f.gguf_archs and (f.gguf_when is None or f.gguf_when(meta or {}))),
                None)


def hf_family(cfg: dict[str, Any]) -> Family | None:
    """The family of an HF config.json (its ``architectures``, then ``model_type``), or None."""
    names = list(cfg.get("architectures") or []) + [cfg.get("model_type")]
    return next((f for n in names for f in FAMILIES if n in f.hf_names), None)


def gguf_names() -> list[str]:
    return sorted({a for f in FAMILIES for a in f.gguf_archs})


def hf_names() -> list[str]:
    return sorted({n for f in FAMILIES for n in f.hf_names if "For" in n})


__all__ = ["FAMILIES", "Family", "GgufFacts", "Sizes", "gguf_family", "hf_family", "gguf_names", "hf_names"]
