"""Shared fixtures. ``default_model_path`` fetches the default GGUF once (into
the user cache, see core/model_files.py) and skips when it cannot."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_path():
    from paged.core.model_files import ModelFetchError, default_model_path as fetch

    try:
        return fetch(quiet=True)
    except ModelFetchError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def default_model_fp32(default_model_path):
    """The default model's LoadedModel in float32 (config, weights, tokenizer), loaded once."""
    import torch

    from paged.core.loaders import load_model_files

    return load_model_files(default_model_path, torch.float32, quiet=True)
