"""GGUF loader: config, tokenizer and weights from one llama.cpp file.

Tensors are renamed to Hugging Face Llama names and dequantised to the
compute dtype. llama.cpp stores Q/K projections of ``llama`` models permuted
for its interleaved RoPE; they are permuted back so the HF half-rotation
convention of our model holds.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from paged.core.models.config import ModelConfig
from paged.core.models.loaders import LoadedModel, ModelLoadError, check_weights
from paged.core.models.loaders.dequant import SUPPORTED_TYPES, dequantize
from paged.core.models.loaders.gguf_reader import GGUFTensor, read_gguf
from paged.core.models.loaders.packed import PACKABLE, PackedBlocks
from paged.core.models.progress import ProgressBar

logger = logging.getLogger("paged")

#: GGUF general.architecture -> our architecture name
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
#: architectures whose Q/K weights llama.cpp's converter permuted
_PERMUTED_QK = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 rope frequency factors
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name (None for tensors the model does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of a Q/K weight (or bias):
    it interleaved each head's two rotary halves; HF keeps them as halves."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(w.shape).contiguous())


class _ArchMetadata:
    """The ``<arch>.*`` keys of one file; counts are checked to be positive
    integers, since a 0 or a string there would fail later, far from its cause."""

    def __init__(self, path: Path, meta: dict[str, Any], arch: str):
        self.path, self.meta, self.arch = path, meta, arch

    def get(self, key: str, default: Any = KeyError) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is KeyError:
            raise ModelLoadError(self.path, f"missing metadata key {full!r}")
        return default

    def count(self, key: str, default: Any = KeyError) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(self.path, f"metadata {self.arch}.{key}: expected a positive integer, "
                                            f"got {value!r}")
        return value


def config_from_metadata(path: Path, meta: dict[str, Any]) -> ModelConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture {gguf_arch!r} "
                                   f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    m = _ArchMetadata(path, meta, gguf_arch)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else m.count("vocab_size")
    hidden = m.count("embedding_length")
    heads = m.count("attention.head_count")
    head_dim = m.count("attention.key_length", m.count("rope.dimension_count", hidden // heads))
    window = m.get("attention.sliding_window", None)
    try:
        return ModelConfig(
            architecture=_ARCHITECTURES[gguf_arch],
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=m.count("feed_forward_length"),
            num_layers=m.count("block_count"),
            num_heads=heads,
            num_kv_heads=m.count("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(m.get("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(m),
            max_position_embeddings=m.count("context_length", 2048),
            tie_word_embeddings=False,  # decided from the tensors present
            qkv_bias=False,  # decided from the tensors present
            sliding_window=m.count("attention.sliding_window") if window else None,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        )
    except ModelLoadError:
        raise
    except (ValueError, TypeError) as e:  # a float or token id that is not a number
        raise ModelLoadError(path, f"bad model metadata: {e}") from e


def _rope_scaling(m: _ArchMetadata) -> dict[str, Any] | None:
    scaling_type = m.get("rope.scaling.type", None)
    if scaling_type in (None, "none"):
        return None
    rope_scaling = {"rope_type": scaling_type, "factor": float(m.get("rope.scaling.factor", 1.0))}
    if m.get("rope.scaling.original_context_length", None) is not None:
        rope_scaling["original_max_position_embeddings"] = m.count("rope.scaling.original_context_length")
    return rope_scaling


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, *, quiet: bool = False,
              keep_packed: bool = False) -> LoadedModel:
    """``keep_packed``: leave matrices of the types the CPU kernels take
    (packed.PACKABLE) as PackedBlocks instead of dequantizing them to ``dtype``."""
    from paged.core.models.tokenizer import Tokenizer

    start = time.perf_counter()
    path = Path(path)
    meta, tensors = read_gguf(path)
    config = config_from_metadata(path, meta)
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)

    weights: dict[str, torch.Tensor] = {}
    with ProgressBar(sum(t.data.nbytes for t in tensors), f"loading {path.name}", unit="B",
                     quiet=quiet) as bar:
        for t in tensors:
            name = hf_tensor_name(t.name)
            if name is not None:
                weights[name] = _load_tensor(path, t, name, config, dtype, keep_packed)
            else:
                logger.debug("gguf: ignoring tensor %s", t.name)
            bar.update(t.data.nbytes)

    if "model.layers.0.self_attn.q_proj.bias" in weights:
        config.qkv_bias = True
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    if "rope_freqs" in weights:
        config.rope_scaling = {"rope_type": "freq_factors"}
        weights["rope_freqs"] = weights["rope_freqs"].float()
    check_weights(path, config, weights)
    logger.info("loaded %s (%s, %d layers, %s) in %.2fs", path.name, config.architecture,
                config.num_layers, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=path)


def _load_tensor(path: Path, t: GGUFTensor, name: str, config: ModelConfig, dtype: torch.dtype,
                 keep_packed: bool = False) -> torch.Tensor | PackedBlocks:
    if t.qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(path, f"tensor {t.name!r} has unsupported quantization type {t.qtype.name} "
                                   f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    try:
        if keep_packed and t.qtype in PACKABLE and len(t.shape) == 2:
            w = _packed(t)
        else:
            w = dequantize(t.data, t.qtype, t.shape, dtype)
    except ValueError as e:
        raise ModelLoadError(path, f"tensor {t.name!r}: {e}") from e
    if config.architecture in _PERMUTED_QK:
        # a row permutation: applies to packed block rows just the same
        heads = {".q_proj.": config.num_heads, ".k_proj.": config.num_kv_heads}
        for part, n in heads.items():
            if part in name:
                w = (w.with_rows(unpermute_qk(w.blocks, n)) if isinstance(w, PackedBlocks)
                     else unpermute_qk(w, n))
    return w


def _packed(t: GGUFTensor) -> PackedBlocks:
    rows, cols = t.shape
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    expected = rows * cols // block * type_size
    if t.data.nbytes != expected:
        raise ValueError(f"{t.qtype.name} data has {t.data.nbytes} bytes, expected {expected} "
                         f"for shape {tuple(t.shape)}")
    blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))  # copy off the mmap
    return PackedBlocks(t.qtype, blocks, (rows, cols))
