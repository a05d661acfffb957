"""Which keywords the installed torch_npu's operators take, read from the
operators themselves at start-up, so one NpuBackend calls every release
correctly instead of the one it was written against.

Read from the PyPI wheels' prototypes (torch_npu/csrc/aten/
npu_native_functions*.yaml and torch_npu/_op_plugin_docs.py):

| torch-npu | npu_scatter_pa_kv_cache | npu_fused_infer_attention_score |
|---|---|---|
| 2.1.0.post17 | no ``cache_mode`` (the layout follows the shapes: ND here) | ``scale`` |
| 2.3.1.post6, 2.4.0.post4, 2.5.1, 2.6.0 | absent | ``scale`` |
| 2.7.1, 2.8.0, 2.9.0 | no ``cache_mode`` | ``scale`` |
| 2.10.0, 2.11.0, 2.12.0, 2.13.0 | ``cache_mode``, default ``'PA_NZ'`` (NZ caches only): ND needs ``'Norm'`` | ``scale`` |

Every release read names the fused operator's scale ``scale``;
``scale_value`` is the older npu_prompt_flash_attention /
npu_incre_flash_attention spelling, chosen only if a build names it so.
Passing ``cache_mode="Norm"`` to a release without it is a TypeError at the
first cache write; omitting it on 2.10+ makes the operator expect an NZ
cache. Without the scatter operator the cache write is a plain index copy
on the device (``NpuBackend._scatter``).

How the keywords are read, in order: the Python signature (the simulator's
operators, tests/npu_sim, have real ones), the registered schema
(``torch.ops.npu.<op>.default._schema``, real torch_npu's builtins), the
prototype line of the operator's docstring. None of them: the 2.13.0
prototype is assumed (and the start-up line says so).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

SCATTER = "npu_scatter_pa_kv_cache"
ATTENTION = "npu_fused_infer_attention_score"
#: 2.13.0's keywords for the two operators: what is assumed when nothing can be read
ASSUMED = {SCATTER: frozenset({"compress_lens", "compress_seq_offsets", "seq_lens", "cache_mode"}),
           ATTENTION: frozenset({"atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table",
                                 "num_heads", "scale", "pre_tokens", "next_tokens", "input_layout",
                                 "num_key_value_heads", "sparse_mode", "block_size"})}


def _python_keywords(fn) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a text signature
        return None
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        return None  # a generic wrapper (*args, **kwargs) says nothing
    return frozenset(p.name for p in params)


def _schema_keywords(name: str) -> frozenset[str] | None:
    try:
        import torch

        return frozenset(a.name for a in getattr(torch.ops.npu, name).default._schema.arguments)
    except (AttributeError, RuntimeError):
        return None


def _doc_keywords(fn, name: str) -> frozenset[str] | None:
    m = re.search(rf"{name}\((.*?)\)\s*->", getattr(fn, "__doc__", None) or "", re.S)
    if not m:
        return None
    return frozenset(re.findall(r"(\w+)\s*(?:=[^,]*)?(?:,|$)", re.sub(r"\([^)]*\)", "", m.group(1))))


def operator_keywords(module, name: str) -> tuple[frozenset[str] | None, str]:
    """(the keyword names ``module.name`` takes, how they were read);
    (None, "absent") when the module has no such operator."""
    fn = getattr(module, name, None)
    if fn is None:
        return None, "absent"
    for how, read in (("signature", lambda: _python_keywords(fn)), ("schema", lambda: _schema_keywords(name)),
                      ("docstring", lambda: _doc_keywords(fn, name))):
        keywords = read()
        if keywords:
            return keywords, how
    if name not in ASSUMED:  # nothing to assume for it: the caller does without
        return None, "unreadable"
    return ASSUMED[name], "assumed (2.13.0)"


@dataclass(frozen=True)
class OperatorPlan:
    """How NpuBackend calls the installed release's operators."""

    version: str
    scatter: bool  # npu_scatter_pa_kv_cache present (else: an index copy)
    scatter_kwargs: dict  # {"cache_mode": "Norm"} where the release takes it
    scale_keyword: str  # "scale" (every release read) or "scale_value"
    read_from: str

    def describe(self) -> str:
        write = (f"{SCATTER}({', '.join(f'{k}={v!r}' for k, v in self.scatter_kwargs.items()) or 'no cache_mode'})"
                 if self.scatter else f"index copy ({SCATTER} absent)")
        return f"torch_npu {self.version}: {write}, {ATTENTION}({self.scale_keyword}=); keywords from {self.read_from}"


def plan(module) -> OperatorPlan:
    """The plan for ``module`` (torch_npu, or the simulator in its place);
    ValueError naming the release when the fused operator lacks a keyword
    NpuBackend cannot do without."""
    scatter, how_s = operator_keywords(module, SCATTER)
    attn, how_a = operator_keywords(module, ATTENTION)
    version = getattr(module, "__version__", "?")
    if attn is None:
        raise ValueError(f"torch_npu {version}: expected {ATTENTION}, got none (pip install torch-npu==2.13.0)")
    scale = next((k for k in ("scale", "scale_value") if k in attn), None)
    missing = sorted({"block_table", "actual_seq_lengths_kv", "block_size", "sparse_mode"} - attn)
    if scale is None or missing:
        raise ValueError(f"{ATTENTION} of torch_npu {version}: expected the keywords block_table, "
                         f"actual_seq_lengths_kv, block_size, sparse_mode and scale (or scale_value), got "
                         f"{sorted(attn)}")
    kwargs = {"cache_mode": "Norm"} if scatter is not None and "cache_mode" in scatter else {}
    return OperatorPlan(version, scatter is not None, kwargs, scale,
                        how_a if scatter is None or how_s == how_a else f"{how_s}/{how_a}")
