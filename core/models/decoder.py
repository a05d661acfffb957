"""The decoder every family runs, as plain torch: it executes a DecoderSpec
(core/models/spec.py) over HF-named weights.

Decode speed on CPU is bound by per-op dispatch, so each layer runs few ops:
Q/K/V are one matmul, gate/up one matmul (every matmul goes through
``layers.linear``, which also takes packed quantized weights), attention is the
platform backend's ``forward`` over the paged KV cache, and the elementwise
rest (residual add + norm, Q/K norms, RoPE + Q/K/V split, the gated
activation) is a ``TorchLayerOps`` the platform's Worker may replace with its
own (single fused C++ passes on the CPU); the Worker may attach a runner that
takes every decoder layer of a step at once (``layer_stack``, described to it
by ``decoder_stack()``, which declines what it cannot run). The model never
asks which device it runs on.

What a layer's description adds to the Llama layer, and where it runs:

- norms: RMSNorm or LayerNorm (``ops.layer_norm``); a +1 offset is added to
  the weight once, here, in float32 (HF Gemma computes x * (1 + w) in float32:
  the same arithmetic); optional norms of the attention and MLP outputs
  before their residual adds (Gemma 3);
- per-head Q/K RMSNorm before the rotation (``ops.qk_norm``: Qwen3, Gemma 3);
- GELU-tanh gated MLP (``ops.gelu_tanh_and_mul``) or an ungated one;
- RoPE tables per distinct RopeSpec (Gemma 3's local and global bases),
  partial rotary, LongRoPE (``layers.RotaryTable``);
- a sliding window and attention scale per layer (``LayerAttention`` where
  they differ from the backend's);
- the embedding scale in the model dtype and a final logit soft-cap;
- a mixture of experts in place of the MLP (core/models/moe.py MoeMlp:
  router, experts grouped per step, an optional shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged.core.models import elementwise
from paged.core.models.config import ModelConfig
from paged.core.models.layer_attention import layer_attention
from paged.core.models.layers import MatrixRole, RotaryTable, SingleDevice, TorchLayerOps, linear, mlp_activation
from paged.core.models.loaders.packed import PackedBlocks, PackedFields, PackedParts, cat_rows
from paged.core.models.moe import MoeMlp
from paged.core.models.spec import DecoderSpec, LayerSpec, MoeSpec, NormSpec


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer's parameters, as a stack runner reads them. Matrices
    are dense tensors or the platform's packed weight objects; norm weights
    have their offset applied; ``spec`` is the layer's description (what a
    runner must execute or decline); a mixture-of-experts layer has ``moe``
    (its experts) and no ``gate_up`` / ``down``."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: object  # rows q, k, v fused
    qkv_bias: torch.Tensor | None
    o_proj: object
    gate_up: object | None  # rows gate, up fused (up alone for an ungated MLP)
    down: object | None
    attn_backend: object
    spec: LayerSpec | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: RotaryTable | None = None
    sliding_window: int = 0
    scale: float | None = None
    moe: MoeMlp | None = None

    def matrices(self) -> list[tuple[str, object]]:
        """(kind, matrix) of every projection of the layer, experts included."""
        out = [("qkv", self.qkv), ("o_proj", self.o_proj)]
        if self.moe is not None:
            return out + self.moe.matrices()
        return out + [("gate_up", self.gate_up), ("down", self.down)]


@dataclass(frozen=True)
class DecoderStack:
    """The public description of a model's decoder stack for a platform's
    whole-stack runner (e.g. backends/cpu/layer_stack.py): shapes, the final
    norm, every layer's weights and the model's description (``spec``), so
    no runner reads private attributes."""

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
    spec: DecoderSpec | None = None
    ropes: tuple = ()


NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "self_attn.output_norm", "mlp.output_norm")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor the model needs."""
    c, spec = config, config.spec
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    shapes.update(_norm_shapes("model.norm", spec.final_norm, c.hidden_size))
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i, layer in enumerate(spec.layers):
        p = f"model.layers.{i}."
        a = layer.attention
        for name, norm in layer.norms().items():
            if norm is not None:
                size = c.head_dim if name.endswith(("q_norm", "k_norm")) else c.hidden_size
                shapes.update(_norm_shapes(p + name, norm, size))
        shapes.update({
            p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
        })
        if layer.moe is None:
            shapes.update(_mlp_shapes(p + "mlp.", c.intermediate_size, c.hidden_size, layer.mlp.gated))
        else:
            shapes.update(_moe_shapes(p + "mlp.", layer.moe, c.hidden_size, layer.mlp.gated))
        if a.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,),
                           p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def _mlp_shapes(prefix: str, inter: int, hidden: int, gated: bool) -> dict[str, tuple[int, ...]]:
    shapes = {prefix + "up_proj.weight": (inter, hidden), prefix + "down_proj.weight": (hidden, inter)}
    if gated:
        shapes[prefix + "gate_proj.weight"] = (inter, hidden)
    return shapes


def _moe_shapes(prefix: str, moe: MoeSpec, hidden: int, gated: bool) -> dict[str, tuple[int, ...]]:
    """The router, every expert's MLP and the shared expert (and its gate)."""
    shapes = {prefix + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes.update(_mlp_shapes(f"{prefix}experts.{e}.", moe.intermediate_size, hidden, gated))
    if moe.shared_intermediate_size:
        shapes.update(_mlp_shapes(prefix + "shared_expert.", moe.shared_intermediate_size, hidden, gated))
    if moe.shared_gate:
        shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _norm_shapes(prefix: str, norm: NormSpec, size: int) -> dict[str, tuple[int, ...]]:
    shapes = {prefix + ".weight": (size,)}
    if norm.kind == "layer":
        shapes[prefix + ".bias"] = (size,)
    return shapes


def _param(t):
    """Dense weights become frozen Parameters; packed weight objects (which
    bring their own ``linear``) are kept as they are."""
    return nn.Parameter(t, requires_grad=False) if isinstance(t, torch.Tensor) else t


class Norm:
    """One norm of a layer: its weight (offset applied) and bias, and how it runs."""

    __slots__ = ("spec", "weight", "bias")

    def __init__(self, spec: NormSpec, weight: torch.Tensor, bias: torch.Tensor | None):
        self.spec, self.weight, self.bias = spec, weight, bias

    def __call__(self, ops: TorchLayerOps, x: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "rms":
            return ops.rms_norm(x, self.weight, self.spec.eps)
        return ops.layer_norm(x, self.weight, self.bias, self.spec.eps)

    def add(self, ops: TorchLayerOps, x: torch.Tensor, residual: torch.Tensor):
        """-> (norm(x + residual), x + residual): the residual add folded in."""
        if self.spec.kind == "rms":
            return ops.add_rms_norm(x, residual, self.weight, self.spec.eps)
        return ops.add_layer_norm(x, residual, self.weight, self.bias, self.spec.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, weights: dict, index: int, dense, make,
                 attn_backend, rope_index: int, parallel=None):
        super().__init__()
        self.parallel = parallel or SingleDevice()
        self.spec = spec
        p = f"model.layers.{index}."
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.inter = c.intermediate_size
        self.eps = spec.attn_norm.eps
        self.index = index
        self.rope_index = rope_index
        a = p + "self_attn."
        norm = lambda name, s: _norm(weights, p + name, s, dense)  # noqa: E731
        self.attn_norm = norm("input_layernorm", spec.attn_norm)
        self.mlp_norm = norm("post_attention_layernorm", spec.mlp_norm)
        self.attn_out_norm = norm("self_attn.output_norm", spec.attn_post_norm) if spec.attn_post_norm else None
        self.mlp_out_norm = norm("mlp.output_norm", spec.mlp_post_norm) if spec.mlp_post_norm else None
        qk = spec.attention.qk_norm
        self.q_norm = norm("self_attn.q_norm", qk) if qk else None
        self.k_norm = norm("self_attn.k_norm", qk) if qk else None
        # the weights a stack runner and the benchmarks read by name
        self.input_norm, self.post_norm = self.attn_norm.weight, self.mlp_norm.weight
        role = lambda kind: MatrixRole(kind, index, c.num_layers)  # noqa: E731
        self.qkv = _param(make([weights[a + n + "_proj.weight"] for n in "qkv"], role("qkv")))
        self.qkv_bias = (_param(dense(torch.cat([dense(weights[a + n + "_proj.bias"]) for n in "qkv"])))
                         if spec.attention.qkv_bias else None)
        self.o_proj = _param(make(weights[a + "o_proj.weight"], role("o_proj")))
        m = p + "mlp."

        def mlp(prefix: str) -> tuple[object, object]:
            """(gate/up rows fused, down) of one MLP."""
            gate_up = [weights[prefix + "gate_proj.weight"]] if spec.mlp.gated else []
            return (_param(make(gate_up + [weights[prefix + "up_proj.weight"]], role("gate_up"))),
                    _param(make(weights[prefix + "down_proj.weight"], role("down"))))

        self.moe = None
        if spec.moe is None:
            self.gate_up, self.down = mlp(m)
        else:
            moe = spec.moe
            self.gate_up = self.down = None
            shared_gate = dense(weights[m + "shared_expert_gate.weight"]) if moe.shared_gate else None
            # the router stays dense (llama.cpp keeps it float32 too): E x H is small
            self.moe = MoeMlp(moe, spec.mlp, dense(weights[m + "gate.weight"]),
                              [mlp(f"{m}experts.{e}.") for e in range(moe.num_experts)], self.parallel,
                              mlp(m + "shared_expert.") if moe.shared_intermediate_size else None, shared_gate)
        att = spec.attention
        self.attn_backend = layer_attention(attn_backend, att.sliding_window, att.scale_for(c.head_dim))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ops: TorchLayerOps,
                rope: RotaryTable, rope_in, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer with the residual add folded into the norms: takes the
        previous layer's (output, residual) and returns its own. The fused ops
        update ``hidden`` and ``residual`` in place."""
        if residual is None:
            x, residual = self.attn_norm(ops, hidden), hidden
        else:
            x, residual = self.attn_norm.add(ops, hidden, residual)

        prompt = meta.first_prompt_row  # a fact about the rows, for packed weights
        qkv = linear(x, self.qkv, self.qkv_bias, first_prompt_row=prompt)
        if self.q_norm is not None:
            qkv = ops.qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                              self.head_dim, self.q_norm.spec.eps)
        q, k, v = ops.rope_split_qkv(qkv, rope, rope_in, self.num_heads, self.num_kv_heads, self.head_dim)
        attn = self.attn_backend.forward(q, k, v, kv_cache, meta)
        hidden = self.parallel.output_projection(attn.view(q.shape[0], self.q_size), self.o_proj, "attention",
                                                 first_prompt_row=prompt)
        if self.attn_out_norm is not None:
            hidden = self.attn_out_norm(ops, hidden)

        x, residual = self.mlp_norm.add(ops, hidden, residual)
        if self.moe is not None:
            hidden = self.moe(x, ops, prompt)
        else:
            act = mlp_activation(ops, linear(x, self.gate_up, first_prompt_row=prompt), self.spec.mlp)
            hidden = self.parallel.output_projection(act, self.down, "mlp", first_prompt_row=prompt)
        if self.mlp_out_norm is not None:
            hidden = self.mlp_out_norm(ops, hidden)
        return hidden, residual


def _norm(weights: dict, prefix: str, spec: NormSpec, dense) -> Norm:
    """A norm's weight as the model dtype, its offset added in float32 first
    (HF Gemma: x * (1.0 + w.float()))."""
    w = weights[prefix + ".weight"]
    if spec.offset:
        w = dense(w).float() + spec.offset
    bias = _param(dense(weights[prefix + ".bias"])) if spec.kind == "layer" else None
    return Norm(spec, _param(dense(w)), bias)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str, attn_backend, packed_linear=None, parallel=None):
        """``weights`` may hold PackedBlocks (GGUF blocks kept packed):
        ``packed_linear`` turns one into the platform's packed weight object
        (e.g. backends.cpu.quant_linear.CpuPackedLinear), told the matrix's
        role when it says it takes one (``takes_role``); without it they are
        dequantized to ``dtype``. A tensor-parallel rank passes its shard's
        config and weights and ``parallel`` (core/engine/distributed/parallel_ops.py):
        the gathers around o_proj and down, the vocab-parallel embedding and
        the logits gather."""
        super().__init__()
        self.parallel = parallel or SingleDevice()
        self.config = config
        self.spec = spec = config.spec
        self.dtype = dtype
        self.device = torch.device(device)

        packed_types = (PackedBlocks, PackedFields, PackedParts)
        takes_role = getattr(packed_linear, "takes_role", False)
        row_parts = getattr(packed_linear, "takes_row_parts", False)  # runs PackedParts (packed.py)

        def dense(t) -> torch.Tensor:
            if isinstance(t, packed_types):
                t = t.dequantize(dtype)
            return t.to(device=self.device, dtype=dtype).contiguous()

        def make(t, role: MatrixRole):
            """One weight, or a list fused along rows (QKV, gate/up): packed
            parts stay packed (of one type; of several, as PackedParts where
            the platform runs them, else as s16 fields), anything else is
            fused dense."""
            if isinstance(t, list):
                t = cat_rows(t, row_parts) if all(isinstance(p, PackedBlocks) for p in t) else \
                    torch.cat([dense(p) for p in t])
            if packed_linear is None or not isinstance(t, packed_types):
                return dense(t)
            return packed_linear(t, role) if takes_role else packed_linear(t)

        embed = weights["model.embed_tokens.weight"]
        # a packed table stays packed: rows are dequantized per lookup (layers.embedding_rows),
        # and a tied head multiplies the same object
        self.embed = _param(make(embed, MatrixRole("embed", None, config.num_layers)))
        final = _norm(weights, "model.norm", spec.final_norm, dense)
        self.final = final
        self.final_norm = final.weight
        tied = spec.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else _param(make(weights["lm_head.weight"],
                                                           MatrixRole("lm_head", None, config.num_layers)))
        if isinstance(self.lm_head, torch.Tensor) and self.lm_head.dtype != torch.float32:
            # logits reach the sampler in float32 whatever the model dtype: a
            # bf16 LM head output ties near-equal tokens (one float32 copy of
            # the head; packed heads compute in float32 already)
            self.lm_head = _param(self.lm_head.detach().float())
        # Gemma scales the embedding rows by sqrt(hidden) in the model dtype
        self.embed_scale = (None if spec.embed_scale is None else
                            torch.tensor(spec.embed_scale, dtype=torch.float32).to(dtype))
        # one table per distinct RoPE (Gemma 3: local and global layers)
        ropes, index = [], []
        for layer in spec.layers:
            rope = layer.attention.rope
            if rope not in ropes:
                ropes.append(rope)
            index.append(ropes.index(rope))
        self.ropes = [RotaryTable.for_spec(r, config.head_dim, config.max_position_embeddings, dtype, self.device,
                                           weights.get("rope_freqs")) for r in ropes]
        self.rope = self.ropes[0]
        self.layers = nn.ModuleList(DecoderLayer(config, layer, weights, i, dense, make, attn_backend, index[i],
                                                 self.parallel) for i, layer in enumerate(spec.layers))
        # elementwise ops of every layer and the whole-stack runner: the
        # platform's Worker replaces them (core/engine/worker.py prepare_model)
        self.ops: TorchLayerOps = TorchLayerOps()
        self.layer_stack = None

    def decoder_stack(self) -> DecoderStack:
        c = self.config
        layers = []
        for layer in self.layers:
            opt = lambda n: None if n is None else n.weight  # noqa: E731
            att = layer.attn_backend
            layers.append(DecoderLayerWeights(
                layer.input_norm, layer.post_norm, layer.qkv, layer.qkv_bias, layer.o_proj, layer.gate_up,
                layer.down, att, layer.spec, opt(layer.attn_out_norm), opt(layer.mlp_out_norm),
                opt(layer.q_norm), opt(layer.k_norm), self.ropes[layer.rope_index],
                layer.spec.attention.sliding_window, layer.spec.attention.scale_for(c.head_dim), layer.moe))
        return DecoderStack(c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
                            float(self.spec.final_norm.eps), self.dtype, self.device, self.final_norm, layers,
                            self.spec, tuple(self.ropes))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.parallel.embed(input_ids, self.embed).to(self.dtype)  # a packed table gives float32 rows
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        ops = self.ops
        rope_ins = [ops.rope_inputs(rope, positions) for rope in self.ropes]
        stack = self.layer_stack
        if stack is not None and stack.accepts(ops) and stack.handles(hidden.shape[0]):
            # all layers in one C++ call
            return stack.run(hidden, rope_ins[0] if len(rope_ins) == 1 else rope_ins, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            i = layer.rope_index
            hidden, residual = layer(hidden, residual, ops, self.ropes[i], rope_ins[i], kv_cache, meta)
        return self.final.add(ops, hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows that need a next token) -> float32 [N, vocab],
        accumulated and kept in float32 (soft-capped where the family does)."""
        logits = self.parallel.gather_logits(linear(hidden.float(), self.lm_head))
        cap = self.spec.final_logit_softcap
        return logits if cap is None else elementwise.tanh(logits / cap) * cap


__all__ = ["DecoderForCausalLM", "DecoderLayer", "DecoderStack", "DecoderLayerWeights", "expected_weight_shapes"]
