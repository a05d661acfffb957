"""Tiny random-weight models of every family, for the oracle tests
(tests/test_families.py): built from a transformers config (random init,
norms and biases perturbed so offsets and biases matter), saved as an HF
folder (safetensors, a small tokenizer, chat template, generation config)
and written to GGUF with gguf-py the way llama.cpp's converter writes them
(its tensor names and metadata keys, Q/K permuted for llama, Gemma's norms
stored as 1 + w, Phi-3's LongRoPE factors as tensors), at F32 or a packed
type (Q8_0). ``hf_on`` gives the HF model on the weights a GGUF file holds
(each matrix quantized and dequantized), the oracle for packed files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from paged.backends.base import AttentionMetadata

BLOCK = 16
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
VOCAB = 128


@dataclass
class Family:
    name: str
    hf_class: str
    config_class: str
    gguf_arch: str
    layers: int
    extra: dict = field(default_factory=dict)
    tokenizer: str = "gpt2"  # GGUF tokenizer.ggml.model
    pre: str = "llama-bpe"
    template: str = ""
    stop: tuple = (2,)  # generation_config eos ids


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
         "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

_rng = np.random.default_rng(3)
SHORT = [round(float(x), 3) for x in 1 + 2 * _rng.random(6)]
LONG = [round(float(x), 3) for x in 2 + 6 * _rng.random(6)]

FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", "LlamaConfig", "llama", 2, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, rope_theta=500000.0, tie_word_embeddings=False),
        template=CHATML),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", "qwen3", 2, dict(
        head_dim=32, tie_word_embeddings=True, rope_theta=1e6), pre="qwen2", template=CHATML),
    "gemma3": Family("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", "gemma3", 7, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        tokenizer="llama", template=GEMMA, stop=(1, 5)),
    "phi3": Family("phi3", "Phi3ForCausalLM", "Phi3Config", "phi3", 2, dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=64, sliding_window=24,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        tokenizer="llama", template=PHI3, stop=(2, 5)),
}


# -- vocabularies -----------------------------------------------------------------

SPECIALS = {"gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
            "phi3": ["<unk>", "<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"],
            "gpt2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
CHARS = list("abcdefghijklmnopqrstuvwxyzTHW.,!?'\n0123456789")


def spm_vocab(family: str, n: int = VOCAB) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of ``n`` pieces: the family's control
    tokens (<unk> as UNKNOWN), the space piece and characters, then pieces
    of common English, scores descending."""
    specials = SPECIALS[family]
    pieces = ["\u2581" + w for w in ("the", "a", "is", "of", "and", "to", "in", "it", "hello", "world")]
    pieces += ["th", "he", "in", "er", "an", "re", "on", "at", "\u2581t", "\u2581a", "\u2581i", "\u2581w",
               "\u2581h", "\u2581o", "\u2581th", "\u2581he", "ll", "llo", "or", "orld", "wor", "\u2581wor"]
    tokens = list(specials) + ["\u2581"] + CHARS
    for p in pieces:
        if p not in tokens and len(tokens) < n:
            tokens.append(p)
    while len(tokens) < n:
        tokens.append(f"<unused{len(tokens)}>")
    types = [2 if t == "<unk>" else 3 for t in specials] + [1] * (len(tokens) - len(specials))
    types = [5 if t.startswith("<unused") else k for t, k in zip(tokens, types)]
    scores = [0.0] * len(specials) + [-100.0 - i for i in range(len(tokens) - len(specials))]
    for i, t in enumerate(tokens):  # longer pieces score higher: merged first
        if types[i] == 1 and len(t) > 1:
            scores[i] = -float(i) / 10
    return tokens, scores, types


def bpe_vocab(n: int = VOCAB) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of ``n`` tokens (GPT-2 byte symbols)."""
    tokens = SPECIALS["gpt2"] + list("\u0120\u010a.,!?'0123456789abcdefghijklmnopqrstuvwxyzTHW")
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "w"), ("e", "r"), ("o", "n")]
    for a, b in merges:
        if len(tokens) < n:
            tokens.append(a + b)
    while len(tokens) < n:
        tokens.append(f"<unused{len(tokens)}>")
    types = [3] * 3 + [1] * (n - 3)
    return tokens, [f"{a} {b}" for a, b in merges], types


# -- HF folders ------------------------------------------------------------------

def hf_config(fam: Family, **overrides):
    import transformers

    kwargs = dict(TINY, vocab_size=VOCAB, num_hidden_layers=fam.layers, **fam.extra)
    kwargs.update(overrides)
    return getattr(transformers, fam.config_class)(**kwargs)


def make_hf(fam: Family, folder: Path, seed: int = 0, **overrides):
    """The HF model (float32, eval) saved in ``folder`` with its tokenizer files."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, fam.hf_class)(hf_config(fam, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    _write_hf_tokenizer(fam, folder)
    return model


def _write_hf_tokenizer(fam: Family, folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models

    if fam.tokenizer == "llama":
        tokens = spm_vocab(fam.name)[0]
        specials = SPECIALS[fam.name]
    else:
        tokens, specials = bpe_vocab()[0], SPECIALS["gpt2"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    eos = tokens[fam.stop[0]]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": specials[min(1, len(specials) - 1)],
                                                              "chat_template": fam.template}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(fam.stop)}))


# -- GGUF files --------------------------------------------------------------------

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
          "post_attention_layernorm": "ffn_norm"}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(fam: Family, hf: str) -> str | None:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = {**_LAYER, **_GEMMA} if fam.name == "gemma3" else _LAYER
    return f"blk.{i}.{table[rest]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K permutation (interleaved rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(fam: Family, model) -> dict[str, np.ndarray]:
    """The model's tensors as llama.cpp's converter writes them (F32)."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g = gguf_name(fam, name)
        if g is None:
            continue
        w = t.detach().float().numpy().copy()
        if fam.name == "llama" and ".attn_q." in g:
            w = _permute(w, cfg.num_attention_heads)
        elif fam.name == "llama" and ".attn_k." in g:
            w = _permute(w, cfg.num_key_value_heads)
        if fam.name == "gemma3" and name.endswith("norm.weight"):
            w = w + 1  # Gemma3RMSNorm's (1 + w), stored applied
        out[g] = w
    if fam.name == "phi3":
        out["rope_factors_long.weight"] = np.array(LONG, dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(SHORT, dtype=np.float32)
    return out


def quantizes(name: str, w: np.ndarray) -> bool:
    return w.ndim == 2 and w.shape[1] % 32 == 0


@pytest.fixture(scope="module", autouse=True)  # imported by the test modules that use these models
def one_thread():
    """Tiny matrices: one thread is fastest, and on a loaded machine torch's
    second thread waits for a core for most of a run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_gguf(fam: Family, model, path: Path, qtype: Q = Q.F32) -> Path:
    cfg = model.config
    w, head_dim = open_gguf(fam, cfg, path)
    if fam.name in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if fam.name == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if fam.name == "llama":  # llama.cpp writes llama3 scaling as rope_freqs factors
        w.add_rope_dimension_count(head_dim)
    if fam.name == "phi3":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_rope_dimension_count(int(cfg.partial_rotary_factor * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(cfg.original_max_position_embeddings))))
        w.add_sliding_window(cfg.sliding_window or 0)
    _add_tokenizer(fam, w)
    tensors = gguf_tensors(fam, model)
    if fam.name == "llama":
        tensors["rope_freqs.weight"] = llama3_factors(cfg, head_dim)
    close_gguf(w, tensors, qtype, quantizes)
    return path


def open_gguf(fam: Family, cfg, path: Path):
    """A GGUF writer holding the keys every decoder's file has, and the head dim."""
    w = gguf.GGUFWriter(str(path), fam.gguf_arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w, head_dim


def close_gguf(w, tensors: dict, qtype: Q, quantizes) -> None:
    """Writes ``tensors`` (at ``qtype`` where ``quantizes(name, data)``, else
    float32) and the file."""
    for name, data in tensors.items():
        if qtype != Q.F32 and quantizes(name, data):
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_factors(cfg, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for HF's llama3 scaling: inv_freq / scaled inv_freq."""
    from paged.core.models.layers import rope_inv_freq

    plain = rope_inv_freq(head_dim, cfg.rope_parameters["rope_theta"], None)
    scaled = rope_inv_freq(head_dim, cfg.rope_parameters["rope_theta"], dict(cfg.rope_parameters))
    return (plain / scaled).numpy().astype(np.float32)


def _add_tokenizer(fam: Family, w) -> None:
    if fam.tokenizer == "llama":
        tokens, scores, types = spm_vocab(fam.name)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(fam.name != "gemma3")
        w.add_bos_token_id(tokens.index(SPECIALS[fam.name][1 if fam.name == "phi3" else 2]))
        w.add_unk_token_id(tokens.index("<unk>"))
    else:
        tokens, merges, types = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(fam.pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
    w.add_eos_token_id(fam.stop[0])
    w.add_chat_template(fam.template)


def hf_on(fam: Family, model, qtype: Q):
    """A copy of the HF model whose matrices hold what a ``qtype`` GGUF of
    it holds (each quantized and dequantized: rows are quantized on their
    own, so llama.cpp's row permutation changes nothing)."""
    return quantized_copy(model, qtype, lambda name, w: gguf_name(fam, name) is not None and quantizes(name, w))


def quantized_copy(model, qtype: Q, quantized):
    """A copy of ``model`` whose parameters ``quantized(name, array)`` picks
    are quantized to ``qtype`` and dequantized (none at F32)."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            w = p.detach().numpy()
            if qtype != Q.F32 and quantized(name, w):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))
    return ref


# -- running paged's model on a paged cache ------------------------------------------

class PagedRunner:
    """Sequences in disjoint block ranges of one paged cache; ``step`` runs
    one batch (every sequence's next chunk at its position) and returns the
    final hidden states of every row."""

    def __init__(self, model, backend, num_layers: int, max_len: int, num_seqs: int):
        self.model = model
        self.per_seq = (max_len + BLOCK - 1) // BLOCK
        self.caches = backend.allocate_kv_cache(num_layers, self.per_seq * num_seqs)
        self.tables = torch.arange(self.per_seq * num_seqs, dtype=torch.int32).view(num_seqs, -1)

    def step(self, seqs: list[int], chunks: list[list[int]], starts: list[int], decodes: int = 0):
        ids, pos, slots, qsl = [], [], [], [0]
        for s, chunk, start in zip(seqs, chunks, starts):
            p = list(range(start, start + len(chunk)))
            ids += chunk
            pos += p
            slots += [s * self.per_seq * BLOCK + x for x in p]
            qsl.append(qsl[-1] + len(chunk))
        lens = [s + len(c) for c, s in zip(chunks, starts)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=self.tables[seqs].contiguous(),
            num_decodes=decodes, max_query_len=max(map(len, chunks)), max_seq_len=max(lens),
            first_prompt_row=qsl[decodes])
        return self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)


def greedy_run(model, backend, num_layers: int, prompts: list[list[int]], new: int, chunk: int | None = None):
    """Batched prefill (in chunks of ``chunk`` tokens per sequence, else
    whole), then ``new`` greedy decode steps of every sequence at once ->
    (logits [rows of each sequence, vocab] per sequence: every prompt row
    and every decode row; generated ids per sequence)."""
    n = len(prompts)
    runner = PagedRunner(model, backend, num_layers, max(map(len, prompts)) + new + 1, n)
    logits = [[] for _ in range(n)]
    done = [0] * n
    while any(d < len(p) for d, p in zip(done, prompts)):
        seqs = [i for i in range(n) if done[i] < len(prompts[i])]
        chunks = [prompts[i][done[i]:done[i] + (chunk or len(prompts[i]))] for i in seqs]
        hidden = runner.step(seqs, chunks, [done[i] for i in seqs])
        out, row = model.compute_logits(hidden), 0
        for i, c in zip(seqs, chunks):
            logits[i].append(out[row:row + len(c)])
            row += len(c)
            done[i] += len(c)
    generated = [[int(logits[i][-1][-1].argmax())] for i in range(n)]
    for step in range(new - 1):
        hidden = runner.step(list(range(n)), [[g[-1]] for g in generated],
                             [len(p) + step for p in prompts], decodes=n)
        out = model.compute_logits(hidden)
        for i in range(n):
            logits[i].append(out[i:i + 1])
            generated[i].append(int(out[i].argmax()))
    return [torch.cat(x) for x in logits], generated
