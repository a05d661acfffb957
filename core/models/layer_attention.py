"""A layer's attention where its sliding window or scale differs from the
backend's (Gemma 3: local layers of 512-1024 tokens beside global ones, and
query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5).

The model has one attention backend, made for the widest window any layer
has (ModelConfig.sliding_window) and the default scale. ``LayerAttention``
runs the backend's ``forward`` with the layer's window and scale in place of
its own for the call, so every kernel call of that layer gets them as
arguments (the contract's ``paged_attention`` / ``prefill_attention`` take
both per call). What a backend derives once per step (``build_metadata``)
is derived for its own window: a backend whose per-step metadata depends on
the window (the NPU's masks) must say it also serves narrower layers
(``per_layer_windows = True``), or a model whose windows differ from its
own is refused here, at build, naming the windows. A backend that derives
nothing per step (the CPU's, the reference) serves any window.

Single-threaded per backend, like the model (each tensor-parallel rank has
its own backend).
"""

from __future__ import annotations

from paged.backends.base import AttentionBackend  # the interface: names no device


class LayerAttention:
    """The backend's attention with this layer's window and scale."""

    def __init__(self, backend, sliding_window: int, scale: float):
        self.backend = backend
        self.sliding_window, self.scale = int(sliding_window), float(scale)

    def forward(self, query, key, value, kv_cache, meta):
        b = self.backend
        saved = b.sliding_window, b.scale
        b.sliding_window, b.scale = self.sliding_window, self.scale
        try:
            return b.forward(query, key, value, kv_cache, meta)
        finally:
            b.sliding_window, b.scale = saved


def serves_any_window(backend) -> bool:
    """Whether ``backend`` attends with a per-call window throughout: it
    derives nothing per step (the base ``build_metadata``), or says so."""
    declared = getattr(backend, "per_layer_windows", None)
    if declared is not None:
        return bool(declared)
    return type(backend).build_metadata is AttentionBackend.build_metadata


def layer_attention(backend, sliding_window: int, scale: float):
    """``backend`` itself where the layer's window and scale are its own,
    else a LayerAttention; ValueError where the window differs and the
    backend's per-step metadata cannot follow it."""
    window = int(sliding_window or 0)
    if window == backend.sliding_window and float(scale) == backend.scale:
        return backend
    if window != backend.sliding_window and not serves_any_window(backend):
        raise ValueError(f"attention backend {backend.name or type(backend).__name__}: expected one sliding window "
                         f"for every layer (its per-step metadata is built for its own, "
                         f"{backend.sliding_window or 'none'}), got a layer with {window or 'none'}")
    return LayerAttention(backend, window, scale)


__all__ = ["LayerAttention", "layer_attention", "serves_any_window"]
