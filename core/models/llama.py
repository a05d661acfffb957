"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Qwen2/2.5, Mistral) as plain torch.

Decode speed on CPU is bound by per-op dispatch, so each layer runs few ops:
Q/K/V are one matmul, gate/up one matmul (every matmul goes through
``layers.linear``, which also takes packed quantized weights), attention is the
platform backend's ``forward`` over the paged KV cache, and the elementwise
rest (residual add + RMSNorm, RoPE + Q/K/V split, SiLU-and-mul) is a
``TorchLayerOps`` the platform's Worker may replace with its own (single
fused C++ passes on the CPU), and the Worker may attach a runner that takes
every decoder layer of a step at once (``layer_stack``, described to it by
``decoder_stack()``). The model never asks which device it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged.core.models.config import ModelConfig
from paged.core.models.loaders.packed import PackedBlocks, PackedFields, cat_rows
from paged.core.models.layers import RotaryTable, SingleDevice, TorchLayerOps, linear


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer's parameters, as a stack runner reads them. Matrices
    are dense tensors or the platform's packed weight objects."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: object  # rows q, k, v fused
    qkv_bias: torch.Tensor | None
    o_proj: object
    gate_up: object  # rows gate, up fused
    down: object
    attn_backend: object


@dataclass(frozen=True)
class DecoderStack:
    """The public description of a model's decoder stack for a platform's
    whole-stack runner (e.g. backends/cpu/layer_stack.py): shapes, the final
    norm and every layer's weights, so no runner reads private attributes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    dtype: torch.dtype
    device: torch.device
    final_norm: torch.Tensor
    layers: list[DecoderLayerWeights]


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the model needs."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,),
                           p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def _param(t):
    """Dense weights become frozen Parameters; packed weight objects (which
    bring their own ``linear``) are kept as they are."""
    return nn.Parameter(t, requires_grad=False) if isinstance(t, torch.Tensor) else t


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int,
                 cast, attn_backend, parallel=None):
        super().__init__()
        self.parallel = parallel or SingleDevice()
        p = f"model.layers.{index}."
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.qk_size = (c.num_heads + c.num_kv_heads) * c.head_dim
        self.inter = c.intermediate_size
        self.eps = c.rms_norm_eps
        self.index = index
        self.attn_backend = attn_backend
        a = p + "self_attn."
        self.input_norm = _param(cast(weights[p + "input_layernorm.weight"]))
        self.post_norm = _param(cast(weights[p + "post_attention_layernorm.weight"]))
        self.qkv = _param(cast([weights[a + n + "_proj.weight"] for n in "qkv"]))
        self.qkv_bias = (_param(cast([weights[a + n + "_proj.bias"] for n in "qkv"]))
                         if c.qkv_bias else None)
        self.o_proj = _param(cast(weights[a + "o_proj.weight"]))
        m = p + "mlp."
        self.gate_up = _param(cast([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]]))
        self.down = _param(cast(weights[m + "down_proj.weight"]))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ops: TorchLayerOps,
                rope: RotaryTable, rope_in, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer with the residual add folded into the norms: takes the
        previous layer's (output, residual) and returns its own. The fused ops
        update ``hidden`` and ``residual`` in place."""
        if residual is None:
            x, residual = ops.rms_norm(hidden, self.input_norm, self.eps), hidden
        else:
            x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)

        # Prompt rows are marked for every matrix; QKV's as the K/V projection,
        # whose outputs are cached and read by every later token (the packed
        # weight decides which cheaper arithmetic its error allows).
        prompt = meta.first_prompt_row
        qkv = linear(x, self.qkv, self.qkv_bias, first_prompt_row=prompt, kv_projection=True)
        q, k, v = ops.rope_split_qkv(qkv, rope, rope_in, self.num_heads, self.num_kv_heads, self.head_dim)
        attn = self.attn_backend.forward(q, k, v, kv_cache, meta)
        hidden = self.parallel.output_projection(attn.view(q.shape[0], self.q_size), self.o_proj, "attention",
                                                 first_prompt_row=prompt)

        x, residual = ops.add_rms_norm(hidden, residual, self.post_norm, self.eps)
        gate_up = linear(x, self.gate_up, first_prompt_row=prompt)
        hidden = self.parallel.output_projection(ops.silu_and_mul(gate_up), self.down, "mlp", first_prompt_row=prompt)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str, attn_backend, packed_linear=None, parallel=None):
        """``weights`` may hold PackedBlocks (GGUF blocks kept packed):
        ``packed_linear`` turns one into the platform's packed weight object
        (e.g. backends.cpu.quant_linear.CpuPackedLinear); without it they are
        dequantized to ``dtype``. A tensor-parallel rank passes its shard's
        config and weights and ``parallel`` (core/engine/distributed/parallel_ops.py):
        the gathers around o_proj and down, the vocab-parallel embedding and
        the logits gather."""
        super().__init__()
        self.parallel = parallel or SingleDevice()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        packed_types = (PackedBlocks, PackedFields)

        def dense(t) -> torch.Tensor:
            if isinstance(t, packed_types):
                t = t.dequantize(dtype)
            return t.to(device=self.device, dtype=dtype).contiguous()

        def cast(t):
            """One weight, or a list fused along rows (QKV, gate/up): packed
            parts stay packed (of one type, or as s16 fields when their types
            differ), anything else is fused dense."""
            if isinstance(t, list):
                t = cat_rows(t) if all(isinstance(p, PackedBlocks) for p in t) else torch.cat([dense(p) for p in t])
            return packed_linear(t) if packed_linear is not None and isinstance(t, packed_types) else dense(t)

        embed = weights["model.embed_tokens.weight"]
        # a packed table stays packed: rows are dequantized per lookup (layers.embedding_rows),
        # and a tied head multiplies the same object
        self.embed = _param(cast(embed))
        self.final_norm = _param(cast(weights["model.norm.weight"]))
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else _param(cast(weights["lm_head.weight"]))
        if isinstance(self.lm_head, torch.Tensor) and self.lm_head.dtype != torch.float32:
            # logits reach the sampler in float32 whatever the model dtype: a
            # bf16 LM head output ties near-equal tokens (one float32 copy of
            # the head; packed heads compute in float32 already)
            self.lm_head = _param(self.lm_head.detach().float())
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, weights, i, cast, attn_backend, self.parallel)
                                    for i in range(config.num_layers))
        self.rope = RotaryTable(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                config.rope_scaling, dtype, self.device, weights.get("rope_freqs"))
        # elementwise ops of every layer and the whole-stack runner: the
        # platform's Worker replaces them (core/engine/worker.py prepare_model)
        self.ops: TorchLayerOps = TorchLayerOps()
        self.layer_stack = None

    def decoder_stack(self) -> DecoderStack:
        c = self.config
        layers = [DecoderLayerWeights(layer.input_norm, layer.post_norm, layer.qkv, layer.qkv_bias, layer.o_proj,
                                      layer.gate_up, layer.down, layer.attn_backend) for layer in self.layers]
        return DecoderStack(c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                            float(c.rms_norm_eps), self.dtype, self.device, self.final_norm, layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.parallel.embed(input_ids, self.embed).to(self.dtype)  # a packed table gives float32 rows
        rope_in = self.ops.rope_inputs(self.rope, positions)
        stack = self.layer_stack
        if stack is not None and stack.accepts(self.ops) and stack.handles(hidden.shape[0]):
            return stack.run(hidden, rope_in, kv_caches, meta)  # all layers in one C++ call
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, self.ops, self.rope, rope_in, kv_cache, meta)
        return self.ops.add_rms_norm(hidden, residual, self.final_norm, self.config.rms_norm_eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows that need a next token) -> float32 [N, vocab],
        accumulated and kept in float32."""
        return self.parallel.gather_logits(linear(hidden.float(), self.lm_head))
