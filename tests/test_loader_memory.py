"""A loaded GGUF model holds no view of the file mapping: a view of even a
tiny norm keeps the whole mapping (every page the loader read) in the
process's RSS, beside the weights' own copies."""

from __future__ import annotations

import numpy as np
from paged.core.models.loaders import gguf_loader, gguf_reader


def test_weights_do_not_view_the_file_mapping(default_model_path, monkeypatch):
    """The CPU engine's load (packed matrices, float32 norms)."""
    seen = {}

    def read_and_keep(path):
        meta, tensors = gguf_reader.read_gguf(path)
        seen["tensors"] = tensors  # keeps the mapping alive for the address check
        return meta, tensors

    monkeypatch.setattr(gguf_loader, "read_gguf", read_and_keep)
    loaded = gguf_loader.load_gguf(default_model_path, quiet=True, keep_packed=True)
    spans = [(t.data.__array_interface__["data"][0], t.data.nbytes) for t in seen["tensors"]]
    lo = min(a for a, _ in spans)
    hi = max(a + n for a, n in spans)

    def views_mapping(t) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return lo <= ptr < hi

    tensors = []
    for name, w in loaded.weights.items():
        parts = [w] if hasattr(w, "untyped_storage") else [getattr(w, f) for f in vars(w)
                                                             if hasattr(getattr(w, f), "untyped_storage")]
        tensors += [(name, t) for t in parts]
    assert tensors and any(np.prod(t.shape) > 0 for _, t in tensors)
    viewing = [name for name, t in tensors if views_mapping(t)]
    assert not viewing, f"weights still viewing the file mapping: {viewing[:5]}"
