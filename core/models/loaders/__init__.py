"""Model file loaders: a .gguf file or a Hugging Face folder -> LoadedModel.

    loaded = load_model_files(path, dtype=torch.bfloat16)
    model = build_model(loaded.config, loaded.weights, dtype, device, attn_backend)

Weights come back under Hugging Face Llama names (``model.layers.0.self_attn.q_proj.weight``)
in the requested dtype, whatever the source format.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from paged.core.models.config import ModelConfig

logger = logging.getLogger("paged")


class ModelLoadError(ValueError):
    """A model file or folder that cannot be loaded; the message names the
    path and the problem."""

    def __init__(self, path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: "paged.core.models.tokenizer.Tokenizer"  # noqa: F821
    chat_template: str | None
    source_path: Path


def load_model_files(path: str | Path, dtype: torch.dtype = torch.float32, *,
                     quiet: bool = False, keep_packed: bool = False) -> LoadedModel:
    """Load a ``.gguf`` file or a Hugging Face folder (config.json +
    *.safetensors + tokenizer.json). Raises ModelLoadError (a ValueError) or
    FileNotFoundError with the path and the problem. ``keep_packed`` leaves
    GGUF Q4_0/Q4_1/Q8_0 matrices as ``PackedBlocks`` (see loaders/packed.py)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or folder")
    if path.is_dir():
        from paged.core.models.loaders.hf_loader import load_hf_folder

        return load_hf_folder(path, dtype, quiet=quiet)
    from paged.core.models.loaders.gguf_loader import load_gguf

    return load_gguf(path, dtype, quiet=quiet, keep_packed=keep_packed)


def check_weights(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor the model needs is present with the right shape."""
    from paged.core.models.decoder import expected_weight_shapes

    for name, shape in expected_weight_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(path, f"tensor {name!r} has shape {tuple(weights[name].shape)}, "
                                       f"expected {shape} from the config")


def read_json(path: Path, required: bool) -> dict:
    """A JSON object file of a model folder; {} when absent and not required;
    ModelLoadError naming the file when it is not a JSON object."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: missing (a Hugging Face model folder needs it)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data

__all__ = ["ModelLoadError", "LoadedModel", "load_model_files", "check_weights", "read_json"]
