"""Mixture-of-experts families paged does not run yet are refused in one
line naming them, from an HF folder and from a GGUF file: OLMoE (its Q/K
norms span the whole projection, not each head as Qwen3's: a different
attention block, not only a different MLP)."""

from __future__ import annotations

import numpy as np
import pytest

from paged.core.models.loaders import ModelLoadError, load_model_files

transformers = pytest.importorskip("transformers")


def _refusal(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model_files(path, quiet=True)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_olmoe_hf_folder_is_refused_in_one_line(tmp_path):
    cfg = transformers.OlmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=1)
    transformers.OlmoeForCausalLM(cfg).save_pretrained(tmp_path)
    assert "unsupported architecture 'OlmoeForCausalLM'" in _refusal(tmp_path)


def test_olmoe_gguf_is_refused_in_one_line(tmp_path):
    from test_moe import _tiny_gguf

    path = _tiny_gguf(tmp_path / "olmoe.gguf", "olmoe", {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32, 32))}, 4)
    assert "unsupported architecture 'olmoe' (a mixture of experts)" in _refusal(path)
