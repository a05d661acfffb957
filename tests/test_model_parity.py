"""Our Llama-family model vs HF transformers (the oracle), through the pure-torch
reference attention backend and a paged KV cache.

- default model (SmolLM2-135M GGUF, float32): prefill logits close to HF's, and
  greedy decoding token-for-token equal over 8 prompts x 32 tokens (a step
  where HF's top-2 margin is tiny is compared by logits instead);
- tiny random-weight Llama-3 (rope scaling, untied head), Qwen2 (qkv bias) and
  Mistral (sliding window) saved as HF folders and loaded by our HF loader.
"""

from __future__ import annotations

import json

import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.reference.attention import ReferenceBackend
from paged.core.models.loaders import load_model_files
from paged.core.models import build_model

transformers = pytest.importorskip("transformers")

BLOCK = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Donne-moi une recette de crêpes.",
    "What is 17 * 23? Show your work.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
NEW_TOKENS = 32
TINY_MARGIN = 1e-3  # HF top-2 logit gap under which a different argmax is a tie


class PagedRunner:
    """Minimal model runner: sequences get disjoint block ranges of one paged
    cache; prefill runs as one varlen batch, decode as one batch of all."""

    def __init__(self, model, backend, num_layers: int, max_len: int, num_seqs: int):
        self.model = model
        self.blocks_per_seq = (max_len + BLOCK - 1) // BLOCK
        self.caches = backend.allocate_kv_cache(num_layers, self.blocks_per_seq * num_seqs)
        self.tables = torch.arange(self.blocks_per_seq * num_seqs, dtype=torch.int32).view(num_seqs, -1)

    def step(self, chunks: list[list[int]], starts: list[int], decode: bool) -> torch.Tensor:
        """chunks[i]: new tokens of sequence i at positions starts[i]...; returns
        logits of each sequence's last new token [num_seqs, vocab]."""
        ids, pos, slots, qsl = [], [], [], [0]
        for i, (chunk, start) in enumerate(zip(chunks, starts)):
            p = list(range(start, start + len(chunk)))
            ids += chunk
            pos += p
            slots += [i * self.blocks_per_seq * BLOCK + x for x in p]
            qsl.append(qsl[-1] + len(chunk))
        seq_lens = [s + len(c) for c, s in zip(chunks, starts)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.tables[:len(chunks)].contiguous(),
            num_decodes=len(chunks) if decode else 0,
            max_query_len=max(len(c) for c in chunks), max_seq_len=max(seq_lens))
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        last = torch.tensor(qsl[1:]) - 1
        return self.model.compute_logits(hidden[last]), hidden


def make_model(loaded, dtype=torch.float32):
    c = loaded.config
    backend = ReferenceBackend(c.num_heads, c.num_kv_heads, c.head_dim, BLOCK, dtype, "cpu",
                               sliding_window=c.sliding_window)
    return build_model(c, loaded.weights, dtype, "cpu", backend), backend


# -- the default model vs transformers on the same GGUF ----------------------

@pytest.fixture(scope="module")
def hf_model(default_model_path):
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(default_model_fp32):
    tok = default_model_fp32.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours_greedy(default_model_fp32, prompt_ids):
    """Our batched greedy run: (prompt logits [sum T, V], generated ids, logits per step [n, steps, V])."""
    model, backend = make_model(default_model_fp32)
    n = len(prompt_ids)
    runner = PagedRunner(model, backend, default_model_fp32.config.num_layers, 256, n)
    logits, hidden = runner.step(prompt_ids, [0] * n, decode=False)
    prefill_logits = model.compute_logits(hidden)
    generated, step_logits = [[] for _ in range(n)], []
    for step in range(NEW_TOKENS):
        step_logits.append(logits)
        for i in range(n):
            generated[i].append(int(logits[i].argmax()))
        if step + 1 < NEW_TOKENS:
            logits, _ = runner.step([[g[-1]] for g in generated],
                                    [len(p) + step for p in prompt_ids], decode=True)
    return prefill_logits, generated, torch.stack(step_logits, dim=1)


@pytest.fixture(scope="module")
def hf_teacher_forced(hf_model, prompt_ids, ours_greedy):
    """HF logits over prompt + our continuation, one forward per prompt. Where
    HF's argmax at every step equals our token, HF's own greedy decoding
    produces exactly our sequence (induction over steps), at 8 forwards
    instead of 8 x 32 sequential generate steps."""
    _, generated, _ = ours_greedy
    with torch.inference_mode():
        return [hf_model(torch.tensor([ids + gen])).logits[0].float()
                for ids, gen in zip(prompt_ids, generated)]


def test_prefill_logits_match_hf(prompt_ids, ours_greedy, hf_teacher_forced):
    prefill_logits = ours_greedy[0]
    start, worst = 0, 0.0
    for ids, ref in zip(prompt_ids, hf_teacher_forced):
        worst = max(worst, (prefill_logits[start:start + len(ids)] - ref[:len(ids)]).abs().max().item())
        start += len(ids)
    print(f"prefill max |logit diff| vs HF: {worst:.2e}")
    assert worst < 1e-3


def test_greedy_decode_matches_hf(prompt_ids, ours_greedy, hf_teacher_forced):
    _, generated, step_logits = ours_greedy
    max_diff, ties = 0.0, 0
    for i, (ids, ref) in enumerate(zip(prompt_ids, hf_teacher_forced)):
        ref_steps = ref[len(ids) - 1:len(ids) - 1 + NEW_TOKENS]  # logits predicting each new token
        max_diff = max(max_diff, (step_logits[i] - ref_steps).abs().max().item())
        for step, ours in enumerate(generated[i]):
            theirs = int(ref_steps[step].argmax())
            if ours != theirs:  # allowed only where HF itself is at a near-tie
                top2 = ref_steps[step].topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin < TINY_MARGIN, (f"prompt {i} step {step}: ours {ours} vs HF {theirs} "
                                              f"(HF margin {margin:.4f})")
                ties += 1
    print(f"decode: {len(prompt_ids)} prompts x {NEW_TOKENS} tokens, max |logit diff| vs HF "
          f"{max_diff:.2e}, near-ties compared by logits: {ties}")
    assert max_diff < 1e-3


# -- tiny random models through the HF folder loader -------------------------

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _tiny_folder(tmp_path, arch: str, **extra):
    cls_name, cfg_name = {"llama": ("LlamaForCausalLM", "LlamaConfig"),
                          "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
                          "mistral": ("MistralForCausalLM", "MistralConfig")}[arch]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_name)(**TINY, **extra)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    _write_tiny_tokenizer(tmp_path)
    return model


def _write_tiny_tokenizer(folder):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


@pytest.mark.parametrize("arch,extra", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                   tie_word_embeddings=False)),
    ("llama", dict(tie_word_embeddings=True, rope_theta=500.0)),
    ("qwen2", dict(tie_word_embeddings=False)),
    ("mistral", dict(sliding_window=8, tie_word_embeddings=False)),
], ids=["llama3-rope", "llama-tied", "qwen2-bias", "mistral-window"])
def test_tiny_models_match_hf(tmp_path, arch, extra):
    hf = _tiny_folder(tmp_path, arch, **extra)
    loaded = load_model_files(tmp_path, torch.float32, quiet=True)
    assert loaded.config.architecture == arch
    model, backend = make_model(loaded)
    torch.manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,)).tolist() for n in (40, 23)]
    runner = PagedRunner(model, backend, loaded.config.num_layers, 64, len(prompts))
    # prefill the first 30 / 15 tokens, then feed the rest one token at a time (decode)
    cut = [30, 15]
    _, hidden = runner.step([p[:c] for p, c in zip(prompts, cut)], [0, 0], decode=False)
    ours = [[model.compute_logits(hidden[:30])], [model.compute_logits(hidden[30:])]]
    for k in range(8):
        logits, _ = runner.step([[p[c + k]] for p, c in zip(prompts, cut)], [c + k for c in cut],
                                decode=True)
        for i in range(2):
            ours[i].append(logits[i:i + 1])
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p[:cut[i] + 8]])).logits[0]
            got = torch.cat(ours[i])
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
