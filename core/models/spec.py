"""A decoder described as data: what every execution path of paged runs.

One ``DecoderSpec`` says, per layer, which norms sit where (RMSNorm or
LayerNorm, before and after attention and MLP, with or without Gemma's +1
offset), the per-head Q/K norms, the biases, the activation and whether the
MLP is gated or a mixture of experts (router, top-k, shared expert), the
rotary embedding (base, scaling, partial rotary dimension, its own per layer
where local and global layers differ), the sliding window, the attention
scale; and for the model: the embedding scale, the final norm,
a final logit soft-cap and whether the LM head is the embedding table.

The loaders build it (core/models/families/: one mapping per family from
GGUF metadata and HF config.json); the Python layers execute it
(core/models/decoder.py, the tests' oracle); a platform's whole-stack runner
executes the same description or declines it (backends/cpu/layer_stack.py);
tensor parallelism shards the weights it names (core/engine/distributed/
sharding.py). Nothing here is a tensor: the description is hashable-free
plain data, compared with ``==``.

Weights keep HF Llama names whatever the family (docs/models.md): a layer's
``input_layernorm`` is the norm before attention, ``post_attention_layernorm``
the norm before the MLP (Llama's name for it), ``self_attn.output_norm`` the
norm of the attention output before the residual add (Gemma's
post_attention_layernorm) and ``mlp.output_norm`` the MLP output's (Gemma's
post_feedforward_layernorm); ``self_attn.q_norm`` / ``k_norm`` the per-head
Q/K norms.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from paged.core.argcheck import fail

NORM_KINDS = ("rms", "layer")
ACTIVATIONS = ("silu", "gelu_tanh")
#: how a mixture-of-experts router turns its logits into scores (MoeSpec.scoring)
MOE_SCORINGS = ("softmax", "sigmoid")
#: rotary scaling kinds the tables implement (core/models/layers.py rope_inv_freq)
ROPE_SCALINGS = ("default", "linear", "llama3", "freq_factors", "longrope")


@dataclass(frozen=True)
class NormSpec:
    """One normalization: ``kind`` "rms" (x / rms(x) * w) or "layer"
    ((x - mean) / std * w + b); the weight is applied as ``offset + w``
    (Gemma's HF checkpoints store w for a (1 + w) scale: offset 1.0; its
    GGUF files store 1 + w already: offset 0.0)."""

    kind: str = "rms"
    eps: float = 1e-5
    offset: float = 0.0

    def __post_init__(self):
        if self.kind not in NORM_KINDS:
            fail("norm kind", " or ".join(NORM_KINDS), self.kind)
        if not self.eps > 0:
            fail("norm eps", "> 0", self.eps)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base ``theta``; ``scaling`` (HF's
    rope_scaling dict with ``rope_type`` one of ROPE_SCALINGS, or None);
    ``rotary_dim`` the leading dimensions of each head that rotate (HF's
    half rotation within them; the rest pass through), None for the whole
    head."""

    theta: float = 10000.0
    scaling: dict[str, Any] | None = None
    rotary_dim: int | None = None

    def __post_init__(self):
        kind = rope_kind(self.scaling)
        if kind not in ROPE_SCALINGS:
            fail("rope scaling type", ", ".join(ROPE_SCALINGS), kind)
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            fail("rotary_dim", "a positive even number", self.rotary_dim)

    def dim(self, head_dim: int) -> int:
        return head_dim if self.rotary_dim is None else self.rotary_dim


def rope_kind(scaling: dict | None) -> str:
    s = scaling or {}
    return s.get("rope_type", s.get("type")) or "default"


@dataclass(frozen=True)
class AttentionSpec:
    """``qkv_bias``: Q/K/V projections have biases; ``qk_norm``: each
    head's Q and K rows are normed (weights over head_dim) before the
    rotation; ``scale`` multiplies q.k (None: head_dim ** -0.5);
    ``sliding_window`` 0 for none, else key j is visible to query i iff
    i - window < j <= i."""

    rope: RopeSpec = field(default_factory=RopeSpec)
    qkv_bias: bool = False
    qk_norm: NormSpec | None = None
    scale: float | None = None
    sliding_window: int = 0

    def __post_init__(self):
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            fail("sliding_window", "an integer >= 0 (0 = none)", self.sliding_window)

    def scale_for(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else float(self.scale)


@dataclass(frozen=True)
class MlpSpec:
    """``activation`` of the gate (gated: act(gate) * up, else act(up))."""

    activation: str = "silu"
    gated: bool = True

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            fail("activation", " or ".join(ACTIVATIONS), self.activation)


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP in place of the dense one: a router
    (``model.layers.i.mlp.gate``, [num_experts, hidden]) scores each row
    (``scoring``: softmax over every expert's logit, or each logit's
    sigmoid), the ``top_k`` best experts run,
    their scores renormalised to sum to 1 where ``normalize``, and the row's
    output is the score-weighted sum of those experts' outputs. Each expert
    (``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj``) is the
    layer's MLP (MlpSpec) of width ``intermediate_size``. A shared expert
    (``mlp.shared_expert.*``, the same MLP of width
    ``shared_intermediate_size``; 0: none) runs on every row and is added,
    scaled by sigmoid(``mlp.shared_expert_gate`` . x) where ``shared_gate``
    (Qwen2-MoE), unscaled otherwise (several shared experts are one wider
    one)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    normalize: bool = True
    shared_intermediate_size: int = 0
    shared_gate: bool = False

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(f"moe {name}", "a positive integer", value)
        if self.top_k > self.num_experts:
            fail("moe top_k", f"at most num_experts ({self.num_experts})", self.top_k)
        if self.scoring not in MOE_SCORINGS:
            fail("moe scoring", " or ".join(MOE_SCORINGS), self.scoring)
        if not isinstance(self.shared_intermediate_size, int) or self.shared_intermediate_size < 0:
            fail("moe shared_intermediate_size", "an integer >= 0 (0 = no shared expert)",
                 self.shared_intermediate_size)
        if self.shared_gate and not self.shared_intermediate_size:
            fail("moe shared_gate", "False without a shared expert", self.shared_gate)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer, pre-norm residual:

        h = h + attn_post_norm?(attention(attn_norm(h)))
        h = h + mlp_post_norm?(mlp(mlp_norm(h)))

    ``moe``: the MLP is a mixture of experts (MoeSpec; ``mlp`` is each
    expert's shape), None for a dense MLP.
    """

    attn_norm: NormSpec = field(default_factory=NormSpec)
    mlp_norm: NormSpec = field(default_factory=NormSpec)
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    mlp: MlpSpec = field(default_factory=MlpSpec)
    attn_post_norm: NormSpec | None = None
    mlp_post_norm: NormSpec | None = None
    moe: MoeSpec | None = None

    def norms(self) -> dict[str, NormSpec | None]:
        """Every norm of the layer by the weight name it reads."""
        return {"input_layernorm": self.attn_norm, "post_attention_layernorm": self.mlp_norm,
                "self_attn.output_norm": self.attn_post_norm, "mlp.output_norm": self.mlp_post_norm,
                "self_attn.q_norm": self.attention.qk_norm, "self_attn.k_norm": self.attention.qk_norm}


@dataclass(frozen=True)
class DecoderSpec:
    """The whole decoder: its layers, the final norm, the embedding rows'
    scale (applied in the model dtype, as Gemma does; None: none), the
    final logits' soft-cap (cap * tanh(logits / cap); None: none) and
    whether the LM head is the embedding table."""

    layers: tuple[LayerSpec, ...]
    final_norm: NormSpec = field(default_factory=NormSpec)
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            fail("decoder layers", "at least one", 0)
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            fail("final_logit_softcap", "> 0 or None", self.final_logit_softcap)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def windows(self) -> list[int]:
        return [layer.attention.sliding_window for layer in self.layers]

    def widest_window(self) -> int:
        """The window a single attention backend must cover: 0 (none) when
        any layer has none, else the largest."""
        w = self.windows()
        return 0 if 0 in w else max(w)

    def with_layers(self, layers) -> "DecoderSpec":
        return replace(self, layers=tuple(layers))

    @property
    def has_experts(self) -> bool:
        return any(layer.moe is not None for layer in self.layers)


def uniform(num_layers: int, layer: LayerSpec, **model) -> DecoderSpec:
    """A decoder whose layers are all alike (``model``: DecoderSpec's other fields)."""
    return DecoderSpec(layers=(layer,) * num_layers, **model)


def llama_like(num_layers: int, *, eps: float = 1e-5, theta: float = 10000.0, scaling: dict | None = None,
               qkv_bias: bool = False, sliding_window: int = 0, tie_word_embeddings: bool = False,
               rotary_dim: int | None = None) -> DecoderSpec:
    """The Llama layer (RMSNorm before attention and MLP, SwiGLU, one RoPE)
    with Qwen2's bias and Mistral's window as options."""
    norm = NormSpec("rms", eps)
    attention = AttentionSpec(RopeSpec(theta, scaling, rotary_dim), qkv_bias=qkv_bias,
                              sliding_window=int(sliding_window or 0))
    return uniform(num_layers, LayerSpec(norm, norm, attention), final_norm=norm,
                   tie_word_embeddings=tie_word_embeddings)


__all__ = ["NormSpec", "RopeSpec", "AttentionSpec", "MlpSpec", "MoeSpec", "LayerSpec", "DecoderSpec", "uniform",
           "llama_like", "rope_kind", "NORM_KINDS", "ACTIVATIONS", "ROPE_SCALINGS",
           "MOE_SCORINGS"]
