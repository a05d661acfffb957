"""Hugging Face folder loader: config.json + *.safetensors + tokenizer files."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from paged.core.models.config import ModelConfig
from paged.core.models.loaders import LoadedModel, ModelLoadError, check_weights, read_json
from paged.core.models.progress import ProgressBar

logger = logging.getLogger("paged")

#: HF ``architectures`` / ``model_type`` -> our architecture name
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "MistralForCausalLM": "mistral", "llama": "llama", "qwen2": "qwen2",
                  "mistral": "mistral"}


def config_from_hf(path: Path, cfg: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    names = list(cfg.get("architectures") or []) + [cfg.get("model_type")]
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(path, f"unsupported architecture {names[0] if names[0] else cfg.get('model_type')!r} "
                                   f"(supported: {', '.join(k for k in _ARCHITECTURES if 'For' in k)})")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        window = None
        if arch == "mistral" or cfg.get("use_sliding_window"):
            window = cfg.get("sliding_window")
        eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
        eos_list = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=_first(generation.get("bos_token_id", cfg.get("bos_token_id"))),
            eos_token_id=eos_list[0] if eos_list else None,
            stop_token_ids=eos_list,
        )
    except KeyError as e:
        raise ModelLoadError(path / "config.json", f"missing key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path / "config.json", f"bad value: {e}") from e


def _first(v):
    if isinstance(v, list):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def load_safetensors(folder: Path, dtype: torch.dtype, quiet: bool) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    total = sum(f.stat().st_size for f in files)
    with ProgressBar(total, f"loading {folder.name}", unit="B", quiet=quiet) as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as st:
                    for name in st.keys():
                        weights[name] = st.get_tensor(name).to(dtype).contiguous()
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise ModelLoadError(file, f"cannot read safetensors ({e})") from e
            bar.update(file.stat().st_size)
    return weights


def load_hf_folder(path: Path, dtype: torch.dtype = torch.float32, *, quiet: bool = False) -> LoadedModel:
    from paged.core.models.tokenizer import Tokenizer

    start = time.perf_counter()
    cfg = read_json(path / "config.json", required=True)
    generation = read_json(path / "generation_config.json", required=False)
    config = config_from_hf(path, cfg, generation)
    tokenizer = Tokenizer.from_hf_folder(path)
    weights = load_safetensors(path, dtype, quiet)
    check_weights(path, config, weights)
    logger.info("loaded %s (%s, %d layers, %s) in %.2fs", path.name, config.architecture,
                config.num_layers, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=path)
