"""GGUF loader: config, tokenizer and weights from one llama.cpp file.

The file's ``general.architecture`` names its family (core/models/families/),
whose mapping builds the decoder description from the ``<arch>.*``
metadata. Tensors are renamed to Hugging Face Llama names (llama.cpp's names
are the same for every family: ``_GLOBAL_NAMES`` / ``_LAYER_NAMES``, with a
family's own exceptions), fused tensors are split into their parts
(Phi-3's ``attn_qkv`` and gate-up ``ffn_up``), and what is not kept packed
is dequantised to the compute dtype. A mixture of experts' 3-D
``ffn_*_exps`` tensors are split into one matrix per expert
(``mlp.experts.e.*``, packed where the rest is); expert tensors of a family
paged has no mapping for are refused, naming them. llama.cpp stores Q/K projections of
``llama`` models permuted for its interleaved RoPE; they are permuted back so
the HF half-rotation convention of our model holds.
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
from paged.core.models.families import Family, GgufFacts, Sizes, gguf_family, gguf_names
from paged.core.models.loaders import LoadedModel, ModelLoadError, check_weights
from paged.core.models.loaders.dequant import SUPPORTED_TYPES, dequantize
from paged.core.models.loaders.gguf_reader import GGUFTensor, read_gguf
from paged.core.models.loaders.packed import PACKABLE, PackedBlocks
from paged.core.models.progress import ProgressBar

logger = logging.getLogger("paged")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3 rope frequency factors
}
#: llama.cpp's per-layer names (the same for every architecture) -> HF Llama names
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",  # the norm before the MLP
    "post_attention_norm": "self_attn.output_norm",  # Gemma: the attention output's norm
    "post_ffw_norm": "mlp.output_norm",  # Gemma: the MLP output's norm
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # fused: split into q/k/v (Phi-3)
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, every expert as one 3-D tensor (split
    # per expert at load), the shared expert and its gate (a vector here)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
#: tensors of a mixture of experts (llama.cpp's names, and the per-expert
#: ``ffn_gate.0`` of old Mixtral conversions): a file whose family does not
#: run them is refused, not loaded without them
_EXPERT_RE = re.compile(r"blk\.\d+\.(ffn_\w*(exps|shexp|_inp|_chexp)\w*|exp_probs_b|ffn_(gate|up|down)\.\d+)\.")


def hf_tensor_name(gguf_name: str, family: Family | None = None) -> str | None:
    """GGUF tensor name -> HF name (None for tensors the model does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if not m:
        return None
    renames = family.gguf_renames if family is not None else {}
    name = renames.get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if name is None else f"model.layers.{m.group(1)}.{name}.{m.group(3)}"


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


def config_from_metadata(path: Path, meta: dict[str, Any], tensors: list[GGUFTensor] = ()) -> ModelConfig:
    """The config of a file: sizes and tokens from the metadata, the decoder
    description from its family's mapping (which may look at which tensors
    the file holds, and read small ones: rope factors)."""
    gguf_arch = meta.get("general.architecture")
    family = gguf_family(gguf_arch, meta)
    if family is None:
        what = " (a mixture of experts)" if meta.get(f"{gguf_arch}.expert_count") else ""
        raise ModelLoadError(path, f"unsupported architecture {gguf_arch!r}{what} "
                                   f"(supported: {', '.join(gguf_names())})")
    m = _ArchMetadata(path, meta, gguf_arch)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else m.count("vocab_size")
    hidden = m.count("embedding_length")
    heads = m.count("attention.head_count")
    # llama.cpp: the head is key_length (default hidden / heads); RoPE turns
    # rope.dimension_count of it (default all: Phi-4-mini turns 3/4)
    head_dim = m.count("attention.key_length", hidden // heads)
    num_layers = m.count("block_count")
    by_name = {t.name: t for t in tensors}
    facts = GgufFacts(m, set(by_name), lambda name: _floats(path, by_name[name]))
    try:
        sizes = Sizes(hidden, num_layers, heads, m.count("attention.head_count_kv", heads), head_dim,
                      m.count("context_length", 2048))
        decoder = family.from_gguf(facts, sizes)
        bos = _opt_int(meta.get("tokenizer.ggml.bos_token_id"))
        eos = _opt_int(meta.get("tokenizer.ggml.eos_token_id"))
        return ModelConfig(
            architecture=family.name,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=m.count("feed_forward_length"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=sizes.num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=sizes.max_position_embeddings,
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=gguf_stop_tokens(meta, eos),
            decoder=decoder,
        )
    except ModelLoadError:
        raise
    except (ValueError, TypeError, KeyError) as e:  # a float or token id that is not a number, a bad setting
        raise ModelLoadError(path, f"bad model metadata: {e}") from e


#: control tokens that end a turn in the chat templates of the families
#: paged loads: stop tokens wherever a file has them, as llama.cpp treats them
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>")
_TOKEN_TYPE_CONTROL = 3


def gguf_stop_tokens(meta: dict[str, Any], eos: int | None) -> list[int]:
    """Every token that ends generation: EOS, the file's end-of-turn /
    end-of-message ids, and control tokens that end a turn in the chat
    templates (Gemma's <end_of_turn> is not its EOS)."""
    ids = [eos] if eos is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None:
            ids.append(int(meta[key]))
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    ids += [i for i, t in enumerate(tokens)
            if t in END_OF_TURN_TOKENS and (i >= len(types) or types[i] == _TOKEN_TYPE_CONTROL)]
    return list(dict.fromkeys(ids))


def _floats(path: Path, t: GGUFTensor) -> list[float]:
    """A small F32 / F16 vector's values (LongRoPE factors)."""
    try:
        return [float(x) for x in dequantize(t.data, t.qtype, t.shape, torch.float32).reshape(-1)]
    except ValueError as e:
        raise ModelLoadError(path, f"tensor {t.name!r}: {e}") from e


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
    config = config_from_metadata(path, meta, tensors)
    family = gguf_family(meta.get("general.architecture"), meta)
    refuse_unmapped_experts(path, family, config, tensors)
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=path)

    weights: dict[str, torch.Tensor] = {}
    with ProgressBar(sum(t.data.nbytes for t in tensors), f"loading {path.name}", unit="B",
                     quiet=quiet) as bar:
        for t in tensors:
            name = hf_tensor_name(t.name, family)
            if name is not None:
                w = _load_tensor(path, t, name, config, dtype, keep_packed, family.gguf_permuted_qk)
                try:
                    weights.update(split_experts(name, w, config) if isinstance(w, list) else
                                   split_fused(name, w, config))
                except ValueError as e:
                    raise ModelLoadError(path, f"tensor {t.name!r}: {e}") from e
            else:
                logger.debug("gguf: ignoring tensor %s", t.name)
            bar.update(t.data.nbytes)

    if "rope_freqs" in weights:
        weights["rope_freqs"] = weights["rope_freqs"].float()
    check_weights(path, config, weights)
    logger.info("loaded %s (%s, %d layers, %s) in %.2fs", path.name, config.architecture,
                config.num_layers, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=tokenizer.chat_template, source_path=path)


def refuse_unmapped_experts(path: Path, family: Family, config: ModelConfig, tensors) -> None:
    """A file with expert tensors its family does not run (experts in a
    dense family's file, old per-expert Mixtral tensors, a router bias) is
    refused in one line naming the first such tensor."""
    layers = config.spec.layers
    for t in tensors:
        if not _EXPERT_RE.match(t.name):
            continue
        layer = int(t.name.split(".")[1])
        if layer >= len(layers) or layers[layer].moe is None or hf_tensor_name(t.name, family) is None:
            raise ModelLoadError(path, f"mixture-of-experts tensor {t.name!r} is not supported for architecture "
                                       f"{family.gguf_archs[0]!r} (paged runs the experts of "
                                       f"{', '.join(moe_family_names())})")


def moe_family_names() -> list[str]:
    from paged.core.models.families.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE

    return [f"{MIXTRAL.name} (llama)", QWEN2_MOE.name, QWEN3_MOE.name]


def split_experts(name: str, parts: list, config: ModelConfig) -> dict:
    """A 3-D expert tensor's per-expert matrices under their own names
    (``mlp.experts.gate_proj`` -> ``mlp.experts.e.gate_proj``)."""
    layer = int(name.split(".")[2])
    moe = config.spec.layers[layer].moe
    if moe is None or len(parts) != moe.num_experts:
        raise ValueError(f"expected {0 if moe is None else moe.num_experts} experts, got {len(parts)}")
    return {name.replace("mlp.experts.", f"mlp.experts.{e}."): p for e, p in enumerate(parts)}


def split_fused(name: str, w, config: ModelConfig) -> dict:
    """{name: w}, or a fused tensor's parts under their own names: Q/K/V rows
    of ``self_attn.qkv_proj``, gate/up rows of ``mlp.gate_up_proj`` (packed
    blocks split by rows, like any matrix)."""
    c = config
    if ".self_attn.qkv_proj." in name:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        parts = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))
        fused = "qkv_proj"
    elif ".mlp.gate_up_proj." in name:
        i = c.intermediate_size
        parts, fused = (("gate_proj", 0, i), ("up_proj", i, 2 * i)), "gate_up_proj"
    else:
        return {name: w}
    if w.shape[0] != parts[-1][2]:
        raise ValueError(f"{name}: expected {parts[-1][2]} rows (its parts fused), got {w.shape[0]}")
    return {name.replace(fused, part): _rows(w, a, b) for part, a, b in parts}


def _rows(w, start: int, end: int):
    if isinstance(w, PackedBlocks):
        return w.with_rows(w.blocks[start:end])
    return w[start:end].contiguous()


def _require_supported(path: Path, t: GGUFTensor) -> None:
    """ModelLoadError naming the tensor and its type unless the loader takes it;
    for llama.cpp's codebook types (IQ1_*, IQ2_*, IQ3_*: lattice grids, not a
    scale times small integers) also what to take instead."""
    if t.qtype in SUPPORTED_TYPES:
        return
    hint = ("; codebook types (IQ1_*, IQ2_*, IQ3_*) are not taken: the same model's IQ4_XS, Q3_K_M or Q2_K "
            "file runs packed") if t.qtype.name.startswith(("IQ1", "IQ2", "IQ3")) else ""
    raise ModelLoadError(path, f"tensor {t.name!r} has unsupported quantization type {t.qtype.name} "
                               f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)}){hint}")


def _load_tensor(path: Path, t: GGUFTensor, name: str, config: ModelConfig, dtype: torch.dtype,
                 keep_packed: bool = False, permuted_qk: bool = False) -> torch.Tensor | PackedBlocks | list:
    """One tensor, dense or packed; a 3-D expert tensor as a list of its
    experts' matrices; the shared-expert gate vector as HF's [1, hidden]."""
    if len(t.shape) == 3:
        return _load_experts(path, t, dtype, keep_packed)
    _require_supported(path, t)
    try:
        if keep_packed and t.qtype in PACKABLE and len(t.shape) == 2:
            w = _packed(t)
        else:
            w = dequantize(t.data, t.qtype, t.shape, dtype)
    except ValueError as e:
        raise ModelLoadError(path, f"tensor {t.name!r}: {e}") from e
    if name.endswith("shared_expert_gate.weight") and w.dim() == 1:
        w = w.unsqueeze(0)
    if permuted_qk:
        # a row permutation: applies to packed block rows just the same
        heads = {".q_proj.": config.num_heads, ".k_proj.": config.num_kv_heads}
        for part, n in heads.items():
            if part in name:
                w = (w.with_rows(unpermute_qk(w.blocks, n)) if isinstance(w, PackedBlocks)
                     else unpermute_qk(w, n))
    return w


def _load_experts(path: Path, t: GGUFTensor, dtype: torch.dtype, keep_packed: bool) -> list:
    """[experts, rows, cols] -> each expert's [rows, cols] matrix (packed
    blocks of the file's type where the rest is kept packed)."""
    _require_supported(path, t)
    experts, rows, cols = t.shape
    try:
        if keep_packed and t.qtype in PACKABLE:
            w = _packed(t, (experts * rows, cols))
            return [w.with_rows(w.blocks[e * rows:(e + 1) * rows]) for e in range(experts)]
        w = dequantize(t.data, t.qtype, t.shape, dtype)
    except ValueError as e:
        raise ModelLoadError(path, f"tensor {t.name!r}: {e}") from e
    return list(w.unbind(0))


def _packed(t: GGUFTensor, shape: tuple[int, int] | None = None) -> PackedBlocks:
    rows, cols = shape or t.shape
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    expected = rows * cols // block * type_size
    if t.data.nbytes != expected:
        raise ValueError(f"{t.qtype.name} data has {t.data.nbytes} bytes, expected {expected} "
                         f"for shape {tuple(t.shape)}")
    blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))  # copy off the mmap
    return PackedBlocks(t.qtype, blocks, (rows, cols))
