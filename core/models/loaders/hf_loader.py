"""Hugging Face folder loader: config.json + *.safetensors + tokenizer files.

config.json's ``architectures`` (or ``model_type``) names the family
(core/models/families/), whose mapping builds the decoder description;
tensors a family names differently are renamed to paged's HF-Llama names
and fused ones split (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

from paged.core.models.config import ModelConfig
from paged.core.models.families import Family, Sizes, hf_family, hf_names
from paged.core.models.loaders import LoadedModel, ModelLoadError, check_weights, read_json
from paged.core.models.loaders.gguf_loader import split_fused
from paged.core.models.progress import ProgressBar

logger = logging.getLogger("paged")

_LAYER_RE = re.compile(r"^(model\.layers\.\d+\.)(.+)\.(weight|bias)$")


def config_from_hf(path: Path, cfg: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    family = hf_family(cfg)
    if family is None:
        names = list(cfg.get("architectures") or []) + [cfg.get("model_type")]
        raise ModelLoadError(path, f"unsupported architecture {names[0] if names[0] else cfg.get('model_type')!r} "
                                   f"(supported: {', '.join(hf_names())})")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        vocab, inter = int(cfg["vocab_size"]), int(cfg["intermediate_size"])
        sizes = Sizes(hidden, int(cfg["num_hidden_layers"]), heads, int(cfg.get("num_key_value_heads") or heads),
                      int(cfg.get("head_dim") or hidden // heads), int(cfg.get("max_position_embeddings", 2048)))
        eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
        eos_list = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        return ModelConfig(
            architecture=family.name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=sizes.num_layers,
            num_heads=heads,
            num_kv_heads=sizes.num_kv_heads,
            head_dim=sizes.head_dim,
            max_position_embeddings=sizes.max_position_embeddings,
            bos_token_id=_first(generation.get("bos_token_id", cfg.get("bos_token_id"))),
            eos_token_id=eos_list[0] if eos_list else None,
            stop_token_ids=eos_list,
            decoder=family.from_hf(cfg, sizes),
        )
    except KeyError as e:
        raise ModelLoadError(path / "config.json", f"missing key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path / "config.json", f"bad value: {e}") from e


def hf_weights(family: Family, config: ModelConfig, weights: dict) -> dict:
    """A checkpoint's tensors under paged's names: the family's renames of
    layer tensors (Gemma's four norms, Mixtral's experts), fused tensors split."""
    out = {}
    for name, w in weights.items():
        m = _LAYER_RE.match(name)
        if m and m.group(2) in family.hf_renames:
            name = f"{m.group(1)}{family.hf_renames[m.group(2)]}.{m.group(3)}"
        elif m and family.hf_rename is not None:
            name = f"{m.group(1)}{family.hf_rename(m.group(2))}.{m.group(3)}"
        out.update(split_fused(name, w, config))
    return out


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
    try:
        weights = hf_weights(hf_family(cfg), config, load_safetensors(path, dtype, quiet))
    except ValueError as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(path, str(e)) from e
    check_weights(path, config, weights)
    logger.info("loaded %s (%s, %d layers, %s) in %.2fs", path.name, config.architecture,
                config.num_layers, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=path)
