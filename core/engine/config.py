"""EngineConfig and the command-line options shared by serve / generate / chat."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

from paged.platforms.sizes import parse_size

from paged.core.engine.spec_decode import parse_speculative_config

def parse_memory_size(text) -> int:
    """--kv-cache-memory: '4GiB', '512MiB', '2.5G' -> bytes; a bare number
    in a string means GiB, an int is already bytes."""
    try:
        size = parse_size(text, bare_unit="GiB")
    except ValueError as e:
        raise ValueError(f"--kv-cache-memory: {e}") from None
    if size <= 0:
        raise ValueError(f"--kv-cache-memory must be > 0, got {text!r}")
    return size


def parse_itl_target(value) -> Optional[float]:
    """--itl-target-ms: milliseconds > 0, or None / 0 (off)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if value is not None and not ok:
        raise ValueError(f"--itl-target-ms: expected a number of milliseconds >= 0 (0: off), got {value!r}")
    return float(value) if value else None


def parse_tensor_parallel_size(value) -> int | str:
    """--tensor-parallel-size: a positive integer or 'auto'."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"--tensor-parallel-size: expected a positive integer or 'auto', got {value!r}")


#: --linear-activations choices; auto = the platform's choice
LINEAR_ACTIVATIONS = ("auto", "float32", "int8", "int8x2", "mixed", "mixed-bf16")

#: --kv-cache-dtype choices (vLLM's flag); auto = Platform.auto_kv_cache_dtype. Which a
#: platform runs: Platform.check_kv_cache_dtype (docs/kernels.md)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: Optional[str] = None  # .gguf file, HF folder or Hub name (org/name[:QUANT]); None: the default SmolLM2
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: Optional[int] = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # prompt tokens a step may carry while sequences decode (None: no cap)
    max_prefill_tokens_with_decodes: Optional[int] = 512
    # while sequences decode, prompt chunks get what keeps a step's predicted
    # time under this (core/engine/prefill_budget.py); None or 0: only the cap above
    itl_target_ms: Optional[float] = 60.0
    block_size: Optional[int] = None  # None: the platform's default
    kv_cache_memory: Optional[int | str] = None  # int bytes or '4GiB'; None: the platform's share of free memory
    num_kv_blocks: Optional[int] = None  # exact block count (tests); overrides kv_cache_memory
    cpu_threads_bind: str = "auto"
    enable_prefix_caching: bool = True
    seed: Optional[int] = 0
    max_waiting: Optional[int] = None  # bounded waiting queue (server 503); None: unbounded
    attention_backend: Optional[str] = None  # "reference" forces the pure-torch oracle
    # keep GGUF Q4_0/Q4_1/Q8_0 matrices packed where the platform has kernels
    # for them (CPU): same values as dequantizing, a fraction of the bytes
    quantized_weights: bool = True
    # what packed linears feed their integer dot products (docs/kernels.md,
    # "Choosing the CPU path"): float32 activations, or int8 per 32-block
    linear_activations: str = "auto"
    # what the KV cache stores (KV_CACHE_DTYPES): auto = the model dtype;
    # bfloat16 halves it under a float32 model, int8 quarters it (plus a
    # float32 scale per token and kv head)
    kv_cache_dtype: str = "auto"
    warm_up: bool = True
    # tensor parallel ranks (docs/distributed.md): an int, or "auto" (CPU:
    # one rank per NUMA node; a device platform: one per device)
    tensor_parallel_size: int | str = 1
    # speculative decoding (docs/speculative.md): vLLM's JSON, e.g.
    # '{"method": "ngram", "num_speculative_tokens": 4}', a dict, or None (off)
    speculative_config: Optional[object] = None
    # share of the GPU's memory the engine may use (weights, activations at
    # the profiled peak, KV cache); GPU platforms only (docs/cuda.md)
    gpu_memory_utilization: float = 0.9
    # decode steps run eagerly instead of replaying captured CUDA graphs
    enforce_eager: bool = False
    # the Hub revision (branch, tag or commit) of a model named org/name; None: main
    revision: Optional[str] = None

    def __post_init__(self) -> None:
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_with_decodes",
                     "block_size",
                     "num_kv_blocks", "max_waiting"):
            positive(name)
        self.itl_target_ms = parse_itl_target(self.itl_target_ms)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        if self.linear_activations not in LINEAR_ACTIVATIONS:
            raise ValueError(f"linear_activations: expected one of {', '.join(LINEAR_ACTIVATIONS)}, "
                             f"got {self.linear_activations!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < float(u) <= 1.0:
            raise ValueError(f"--gpu-memory-utilization: expected a fraction in (0, 1], got {u!r}")
        self.gpu_memory_utilization = float(u)
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.tensor_parallel_size = parse_tensor_parallel_size(self.tensor_parallel_size)
        if self.revision is not None:
            self._attach_revision()
        if self.attention_backend not in (None, "reference"):
            raise ValueError(f"attention_backend must be None or 'reference', got {self.attention_backend!r}")

    def _attach_revision(self) -> None:
        """The revision travels with the model name (hub.ModelName): the
        engine resolves ``config.model`` (core/models/files.py)."""
        from paged.core.models.hub import ModelName, RepoSpec

        rev = self.revision
        if not isinstance(rev, str) or not rev.strip() or rev != rev.strip() or any(c.isspace() for c in rev):
            raise ValueError(f"--revision: expected a branch, tag or commit of the Hub repo, got {rev!r}")
        if self.model is None or RepoSpec.parse(str(self.model)) is None:
            raise ValueError(f"--revision {rev!r}: only for a model named on the Hugging Face Hub "
                             f"(--model org/name), got --model {self.model!r}")
        self.model = ModelName(str(self.model), rev)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face model folder, or a model on the Hugging Face Hub: org/name "
                        "(safetensors, or its GGUF) or org/name:QUANT (the GGUF file matching QUANT, as llama.cpp's "
                        "-hf); fetched into the Hub cache, HF_HUB_OFFLINE=1 uses the cache only "
                        "(default: SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a --model named on the Hub (default: main)")
    g.add_argument("--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16 (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"most sequences in one step (default: {d.max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help=f"token budget of one step; longer prompts are prefilled in chunks "
                        f"(default: {d.max_num_batched_tokens})")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=d.max_prefill_tokens_with_decodes,
                   help="prompt tokens a step may carry while sequences decode: the ceiling of the "
                        "--itl-target-ms budget, or with --itl-target-ms 0 the fixed budget (bounds the "
                        "inter-token latency that prefills add, at some cost to time to first token) "
                        f"(default: {d.max_prefill_tokens_with_decodes})")
    g.add_argument("--itl-target-ms", type=float, default=d.itl_target_ms,
                   help="while sequences decode, give prompt chunks what keeps a step's predicted time (learned "
                        "from the engine's own steps) under this many milliseconds, at least the decodes' own "
                        "time and at most --max-prefill-tokens-with-decodes; 0: the fixed cap only "
                        f"(default: {d.itl_target_ms:g})")
    g.add_argument("--block-size", type=int, default=None, help="KV cache block size in tokens (default: the platform's: cpu 128, cuda 16, npu 128)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size, e.g. 4GiB or 512MiB (default: a share of free memory)")
    g.add_argument("--cpu-threads-bind", default=d.cpu_threads_bind,
                   help="auto | none | <cpu list>[|<cpu list>...], one list per tensor parallel rank "
                        "(CPU platform)")
    g.add_argument("-tp", "--tensor-parallel-size", default=d.tensor_parallel_size,
                   help="ranks the model is sharded over: N, or auto (CPU: one per NUMA node); on one "
                        "machine they are spawned, under torchrun they are torchrun's (default: 1)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching, help="automatic prefix caching (default: on)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded sampling (default: 0)")
    g.add_argument("--quantized-weights", action=argparse.BooleanOptionalAction, default=d.quantized_weights,
                   help="run GGUF Q4_0/Q4_1/Q8_0 weights packed on platforms with kernels for them "
                        "(CPU); --no-quantized-weights dequantizes them to --dtype (default: on)")
    g.add_argument("--linear-activations", choices=LINEAR_ACTIVATIONS, default=d.linear_activations,
                   help="activations of packed-weight linears: float32 (exact to fp32 rounding), int8 "
                        "(quantized per 32 values, integer dot products: faster, bitwise batch invariant), "
                        "int8x2 (int8 plus the residual's int8: float32's accuracy, integer speed), "
                        "mixed (int8x2 for decodes and the K/V projection, int8 for the rest of prompts), "
                        "mixed-bf16 (int8x2 for decodes, bfloat16 on AMX tiles for prompts; CPUs with AMX-BF16), "
                        "auto = the platform's choice (CPU: mixed-bf16 where it runs, else mixed) (default: auto)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="what the KV cache stores: auto = the platform's choice (CPU: float16 under a float32 "
                        "model with quantized linear activations, else the model dtype); bfloat16; int8 (a "
                        "float32 scale per token and kv head: ~4x the tokens of a float32 cache; CPU only); "
                        "fp8_e4m3 (the same rows as float8_e4m3fn codes, scale = max|x| / 448; CPU only) "
                        "(default: auto)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="share of the GPU's memory to use for weights, activations and the KV cache; "
                        "the KV cache gets what a profiled worst-case step leaves (GPU platforms; "
                        f"default: {d.gpu_memory_utilization})")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="run decode steps eagerly instead of replaying CUDA graphs (GPU platforms: "
                        "less start-up time and memory, more launch overhead per step)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (n-gram prompt lookup; '
                        'default: off)')


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """EngineConfig from parsed options (args.device is the CLI's global --device)."""
    values = dict(
        model=args.model,
        revision=getattr(args, "revision", None),
        device=getattr(args, "device", None) or "auto",
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        itl_target_ms=args.itl_target_ms,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        cpu_threads_bind=args.cpu_threads_bind,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        quantized_weights=args.quantized_weights,
        linear_activations=args.linear_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    values.update(overrides)
    return EngineConfig(**values)
