"""GGUF loader: config, tokenizer and weights from one llama.cpp file.

Tensors are renamed to Hugging Face Llama names and dequantised to the
compute dtype. llama.cpp stores Q/K projections of ``llama`` models permuted
for its interleaved RoPE; they are permuted back so the HF half-rotation
convention of our model holds.
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from paged.core.config import ModelConfig
from paged.core.loaders import LoadedModel, ModelLoadError, check_weights
from paged.core.loaders.dequant import SUPPORTED_TYPES, dequantize
from paged.core.loaders.packed import PACKABLE, PackedBlocks
from paged.core.progress import ProgressBar

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


def config_from_metadata(path: Path, meta: dict[str, Any]) -> ModelConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise ModelLoadError(path, f"unsupported architecture {gguf_arch!r} "
                                   f"(supported: {', '.join(sorted(_ARCHITECTURES))})")

    def get(key: str, default: Any = KeyError) -> Any:
        full = f"{gguf_arch}.{key}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise ModelLoadError(path, f"missing metadata key {full!r}")
        return default

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else get("vocab_size")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
    rope_scaling = None
    scaling_type = get("rope.scaling.type", None)
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length", None)
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    window = get("attention.sliding_window", None)
    try:
        return ModelConfig(
            architecture=_ARCHITECTURES[gguf_arch],
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=False,  # decided from the tensors present
            qkv_bias=False,  # decided from the tensors present
            sliding_window=int(window) if window else None,
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        )
    except (ValueError, TypeError) as e:
        raise ModelLoadError(path, f"bad model metadata: {e}") from e


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


# -- a small GGUF reader ------------------------------------------------------
# gguf.GGUFReader builds a numpy view per metadata item, which takes seconds for
# a 49k-token vocabulary; this reader walks the header with struct instead and
# memory-maps tensor data.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (rows first)
    qtype: GGMLQuantizationType
    data: np.ndarray  # raw uint8 bytes (a view of the memory-mapped file)


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(self.path, f"truncated GGUF header (needed {size} bytes at offset {self.pos})")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(self.path, f"truncated GGUF header (string of {n} bytes at offset {self.pos})")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
                if self.pos + count * dt.itemsize > len(self.buf):
                    raise ModelLoadError(self.path, f"truncated GGUF header (array at offset {self.pos})")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(itype) for _ in range(count)]
        raise ModelLoadError(self.path, f"malformed GGUF header: unknown value type {vtype} at offset {self.pos}")


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Parse a GGUF v2/v3 file: (metadata, tensors with memory-mapped data)."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot read file ({e})") from e
    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise ModelLoadError(path, f"malformed GGUF header: tensor {name!r} has {n_dims} dimensions")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        qtype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, dims, qtype, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, qtype, offset in infos:
        try:
            qt = GGMLQuantizationType(qtype)
            block, type_size = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise ModelLoadError(path, f"tensor {name!r} has unknown GGML type {qtype}") from None
        numel = int(np.prod(dims)) if dims else 1
        n_bytes = numel // block * type_size
        begin = data_start + offset
        if begin + n_bytes > len(buf):
            raise ModelLoadError(path, f"truncated: tensor {name!r} needs bytes {begin}..{begin + n_bytes} "
                                       f"but the file has {len(buf)}")
        data = np.frombuffer(buf, dtype=np.uint8, count=n_bytes, offset=begin)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), qt, data))
    return meta, tensors


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, *, quiet: bool = False,
              keep_packed: bool = False) -> LoadedModel:
    """``keep_packed``: leave Q4_0/Q4_1/Q8_0 matrices as PackedBlocks (for the
    CPU quantized-linear kernels) instead of dequantizing them to ``dtype``."""
    from paged.core.tokenizer import Tokenizer

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
        if keep_packed and t.qtype in PACKABLE and len(t.shape) == 2 and t.shape[1] % 32 == 0:
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
    _, type_size = GGML_QUANT_SIZES[t.qtype]
    expected = rows * cols // 32 * type_size
    if t.data.nbytes != expected:
        raise ValueError(f"{t.qtype.name} data has {t.data.nbytes} bytes, expected {expected} "
                         f"for shape {tuple(t.shape)}")
    blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))  # copy off the mmap
    return PackedBlocks(t.qtype, blocks, (rows, cols))
