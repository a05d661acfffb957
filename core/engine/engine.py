"""Engine: schedule -> run -> sample -> update, one step at a time.

    engine = Engine(EngineConfig(...))   # the platform's Worker loads the model, sizes the KV cache, warms up
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...   # RequestOutput, cumulative text / token ids

Not thread-safe: one thread drives it (core/entrypoints/async_engine.py for the server).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Union

import torch

from paged.core.engine.distributed.group import RankGroup, start_group
from paged.core.engine.config import EngineConfig
from paged.core.engine.outputs import RequestOutput
from paged.core.engine.prefill_budget import PrefillBudget
from paged.core.engine.request import Request, Sequence
from paged.core.engine.sampler import Sampler, top_logprobs
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import Scheduler, WaitingQueueFull
from paged.core.engine import step_trace
from paged.core.engine.spec_decode import NgramProposer, SampleRows, SpecStats, accept
from paged.core.engine.structured.compiler import GrammarCompiler, GrammarError
from paged.core.engine.structured.pending import PendingGrammars

log = logging.getLogger("paged.engine")
#: guards the lazy creation of Engine.grammars (the server's thread and the engine's may race to it)
_GRAMMARS_LOCK = threading.Lock()
#: how long a step with nothing to run waits for a compilation before returning
GRAMMAR_WAIT_S = 0.05


def resolve_platform(device: str):
    """The Platform for --device (auto picks the best available); becomes
    the process's current platform."""
    from paged.platforms import get_platform, set_current_platform

    platform = get_platform(device or "auto")
    set_current_platform(platform)
    return platform


def describe_weights(weights: dict, path: str, activations: str | None) -> str:
    """e.g. "GGUF q4_1+q8_0 packed (float32 activations), float32 dense":
    the file format, what the matrices are kept as and what they multiply."""
    from paged.core.models.loaders.packed import PackedBlocks
    from paged.core.models.loaders.quant_layouts import HALF_LAYOUTS

    layouts = {w.kernel_type for w in weights.values() if isinstance(w, PackedBlocks)}
    half = sorted(layouts & set(HALF_LAYOUTS))  # 16-bit values, float32 activations on every path
    quant = sorted(layouts - set(half))
    dense = sorted({str(w.dtype).removeprefix("torch.") for w in weights.values() if isinstance(w, torch.Tensor)})
    fmt = "GGUF" if path.endswith(".gguf") else "safetensors"
    kept = f"packed ({activations} activations)" if activations else "dequantized"
    parts = [f"{'+'.join(quant)} {kept}"] if quant else []
    parts += [f"{'+'.join(half)} {'16-bit (float32 activations)' if activations else 'dequantized'}"] if half else []
    parts += [f"{'+'.join(dense)} dense"] if dense else []
    return f"{fmt} {', '.join(parts)}"


class StepFailed(RuntimeError):
    """Engine.step() failed some requests and aborted them: `errors` maps
    their ids to the cause; `outputs` are the step's outputs for the others."""

    def __init__(self, errors: dict[str, Exception], outputs: list[RequestOutput]):
        first = next(iter(errors.values()))
        super().__init__(f"{len(errors)} request(s) failed in an engine step: {type(first).__name__}: {first}")
        self.errors, self.outputs = errors, outputs


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, group: Optional[RankGroup] = None):
        """``group``: a tensor-parallel follower's (core/engine/distributed/rank.py);
        rank 0 forms its own (spawned ranks, or torchrun's), none for -tp 1."""
        self.config = config = config or EngineConfig()
        self.platform = resolve_platform(config.device)
        self.group = group or start_group(config, self.platform)
        try:
            self._start(config)
        except BaseException as exc:
            error = self.group.abort(exc)  # no rank is left waiting in a collective
            if error is exc:
                raise
            raise error from exc  # names the rank that died

    def _start(self, config: EngineConfig) -> None:
        from paged.core.engine.kv_cache_manager import KVCacheManager, shared_block_pool
        from paged.core.models.config import resolve_dtype
        from paged.core.models.files import resolve_model
        from paged.core.models.loaders import load_model_files

        # the platform says what it can do; everything device-specific is the worker's (core/engine/worker.py)
        self.worker = worker = self.platform.worker_cls()(self.platform, self.group.rank, self.group.world_size,
                                                          self.group)
        worker.init_device(threads_bind=config.cpu_threads_bind, max_num_seqs=config.max_num_seqs,
                           gpu_memory_utilization=config.gpu_memory_utilization, enforce_eager=config.enforce_eager)
        self.device = worker.device
        self.dtype = resolve_dtype(config.dtype, self.platform)
        self.block_size = config.block_size or self.platform.default_block_size
        # the platform's declaration is binding: refuse what it does not accept, before loading
        caps = self.platform.capabilities()
        caps.check(self.platform.name, block_size=self.block_size, dtype=self.dtype)
        self.linear_activations = self._linear_activations(config)
        self.kv_cache_dtype = worker.kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.linear_activations)

        path = resolve_model(config.model)  # None: the default model, fetched once and cached
        t0 = time.perf_counter()
        loaded = load_model_files(str(path), self.dtype, keep_packed=self.linear_activations is not None)
        self.model_path = str(path)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        caps.check(self.platform.name, head_size=mc.head_dim)  # before the model goes onto the device
        self.weight_format = describe_weights(loaded.weights, self.model_path, self.linear_activations)
        worker.load_model(mc, loaded.weights, self.dtype, self.block_size, self.linear_activations,
                          config.attention_backend, kv_cache_dtype=self.kv_cache_dtype)
        self.attn_backend = worker.backend
        del loaded

        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's context length "
                             f"({mc.max_position_embeddings})")
        num_blocks = config.num_kv_blocks or worker.determine_num_blocks(
            config.kv_cache_memory, self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens)
        # one sequence must always fit on its own, or preemption could not make progress
        self.max_model_len = min(self.max_model_len, num_blocks * self.block_size)
        worker.init_kv_cache(num_blocks)

        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                               *shared_block_pool())
        prefill_budget = PrefillBudget(config.itl_target_ms / 1000, config.max_prefill_tokens_with_decodes) \
            if config.itl_target_ms else None  # learns this engine's step costs (rank 0 schedules)
        self.scheduler = Scheduler(self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_waiting, config.enable_prefix_caching,
                                   config.max_prefill_tokens_with_decodes,
                                   NgramProposer(config.speculative_config) if config.speculative_config else None,
                                   prefill_budget)
        self.spec_stats = SpecStats() if config.speculative_config else None
        self.stop_token_ids = set(mc.stop_token_ids or ([] if mc.eos_token_id is None else [mc.eos_token_id]))
        self.eos_token_id = mc.eos_token_id
        self.sampler = Sampler(sorted(self.stop_token_ids), config.seed, worker.argmax)
        if config.warm_up:
            worker.warm_up()
        self._trace = step_trace.from_env()  # after the warm-up: only served steps are traced
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = 0
        dtype_how = "auto" if str(config.dtype).strip().lower() == "auto" else "--dtype"
        summary = worker.startup_summary()
        reserved, committed = num_blocks * worker.bytes_per_block / 2**30, worker.kv_cache_committed_bytes()
        memory = f"{reserved:.2f} GiB" if committed is None else \
            f"{reserved:.2f} GiB reserved, {committed / 2**30:.2f} GiB committed now"
        log.info("engine ready in %.1f s: %s on %s; dtype %s (%s); weights %s; KV cache %s, %d blocks x %d "
                 "tokens = %d tokens fit (%s)%s", time.perf_counter() - t0, self.model_path, self.platform.name,
                 str(self.dtype).removeprefix("torch."), dtype_how, self.weight_format,
                 str(self.kv_cache_dtype).removeprefix("torch."), num_blocks, self.block_size,
                 num_blocks * self.block_size, memory, f"; {summary}" if summary else "")

    def _linear_activations(self, config: EngineConfig) -> str | None:
        """What the worker's packed-weight linears multiply (GGUF blocks kept
        packed), or None: no such kernels here, or --quantized-weights off
        (the weights are dequantized to --dtype at load)."""
        mode = self.worker.linear_activations(config.linear_activations) if config.quantized_weights else None
        if config.linear_activations != "auto" and mode is None:
            raise ValueError(f"--linear-activations {config.linear_activations}: {self.platform.name} runs no "
                             "packed-weight linears here (quantized weights are dequantized to --dtype)")
        return mode

    def close(self) -> None:
        """Ends a tensor-parallel group (the other ranks stop and exit); a
        one-rank engine has nothing to end."""
        trace, self._trace = getattr(self, "_trace", None), None  # None too when __init__ failed before it
        if trace is not None:
            trace.close()
        self.worker.shutdown()

    @property
    def runner(self):
        """The worker's step runner (its model, KV caches, step inputs)."""
        return self.worker.runner

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        params.validate_for_vocab(vocab)
        if self._num_compiling() and request_id in self.grammars:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt + at least one generated token must fit)")
        req = Request(request_id, text, ids, params, arrival_time)
        room = self.max_model_len - len(ids)
        req.max_tokens = min(params.max_tokens or room, room)
        self._init_output_state(req.seqs[0])
        if params.structured_outputs is not None and self._hold_for_grammar(req):
            return  # compiling off this thread; a later step() schedules it
        self.scheduler.add_request(req)

    def _hold_for_grammar(self, req: Request) -> bool:
        """Sets req's matcher when its constraint is compiled (False); else
        holds req until its compilation ends (True). Held requests count
        towards max_waiting, and their ids are taken."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        limit = self.scheduler.max_waiting
        if limit is not None and len(self.scheduler.waiting) + len(self.grammars) >= limit:
            raise WaitingQueueFull(f"the waiting queue is full ({limit} requests)")
        return self.grammars.hold(req)

    @property
    def grammars(self) -> PendingGrammars:
        """Structured output: the grammar compiler and the requests waiting
        for it. Made on first use (an engine that never sees a constraint
        never builds llguidance's tokenizer); thread-safe, the server
        compiles through it too."""
        with _GRAMMARS_LOCK:
            if "_grammars" not in self.__dict__:
                compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.stop_token_ids))
                self._grammars = PendingGrammars(compiler)
        return self._grammars

    def _num_compiling(self) -> int:
        held = self.__dict__.get("_grammars")
        return 0 if held is None else len(held)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Stops the request and frees its blocks; returns its final output
        (finish_reason 'abort'), or None when it is unknown or already done."""
        req = self.scheduler.abort_request(request_id)
        if req is None and self._num_compiling():
            req = self.grammars.abort(request_id)
            if req is not None:
                req.seqs[0].finish("abort")
        if req is None:
            return None
        req.metrics.finished_time = time.time()
        return req.output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._num_compiling() > 0

    # -- one step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step. A failure stays with the requests it belongs to: a
        failing forward fails this step's requests, a failing sample or
        detokenization only its own; StepFailed names them (already aborted)
        and carries the other requests' outputs."""
        started, t_start = step_trace.now(), time.perf_counter()
        self.platform.bind_thread()  # the server steps from its own thread
        failed = self._admit_compiled()
        out = self.scheduler.schedule()
        if out.empty:
            if failed:
                raise self._fail(failed, [])
            if self._num_compiling():
                self.grammars.wait(GRAMMAR_WAIT_S)  # nothing to run until a compilation ends
            return []
        try:
            tables = [self.kv_cache_manager.block_table(e.seq.seq_id) for e in out.scheduled]
            t0 = time.perf_counter()
            result = self.worker.execute(out, tables)
        except Exception as exc:  # noqa: BLE001 - the batch is lost, the waiting requests are not
            raise self._fail({**failed, **{s.seq.group.request_id: exc for s in out.scheduled}}, [])
        self.scheduler.advance(out)
        for e in out.prefills:
            self.num_prompt_tokens += e.num_new_tokens
        touched: dict[str, Request] = {}
        for e, logits in result.prompt_logits:
            self._per_request(failed, e.seq, self._add_prompt_logprobs, e, logits)
        if result.sample_seqs:
            seqs, rows = self._fork_finished_prompts(result.sample_seqs)
            drafts = {e.seq.seq_id: e.draft for e in out.verifies}
            plan = SampleRows.build(result.sample_seqs, seqs, rows, drafts)
            identity = not drafts and len(seqs) == len(result.sample_seqs)
            logits = result.logits if identity else result.logits[plan.logit_rows]
            sampled, errors = self.sampler.sample_isolated(logits, plan.row_seqs, plan.row_drafts if drafts else None)
            now = time.time()
            decoding = {e.seq.seq_id for e in out.decodes} if self.spec_stats else ()
            for seq, span in zip(seqs, plan.spans):
                error = next((errors[r] for r in span if r in errors), None)
                if error is not None:
                    failed.setdefault(seq.group.request_id, error)
                elif self._per_request(failed, seq, self._emit, seq, sampled, span, drafts.get(seq.seq_id),
                                       seq.seq_id in decoding, now):
                    touched[seq.group.request_id] = seq.group
        self._observe_step(out, time.perf_counter() - t0, started, t_start)
        outputs = [req.output() for rid, req in touched.items() if rid not in failed]
        if failed:
            raise self._fail(failed, outputs)
        return outputs

    def _observe_step(self, out, seconds: float, started: float, t_start: float) -> None:
        """Feeds the prefill budget's cost model (--itl-target-ms) this step's
        rows and time from the forward's start to the sampled tokens (on a
        GPU sampling waits for the forward, so it is the device's time), and
        the step trace (PAGED_STEP_TRACE) its line."""
        budget = self.scheduler.prefill_budget
        prompt_rows = sum(e.num_new_tokens for e in out.prefills)
        if budget is not None:
            budget.observe(out.num_tokens - prompt_rows, prompt_rows, seconds)
        if self._trace is not None:
            self._trace.record(started, time.perf_counter() - t_start, seconds, out.num_tokens - prompt_rows,
                               prompt_rows, len(out.scheduled))

    def _admit_compiled(self) -> dict[str, Exception]:
        """Schedules the held requests whose constraint has compiled; returns
        {request id: error} for those whose constraint failed."""
        if not self._num_compiling():
            return {}
        ready, failed = self.grammars.collect()
        for req in ready:
            self.scheduler.add_request(req)
        return failed

    @staticmethod
    def _per_request(failed: dict[str, Exception], seq: Sequence, work, *args) -> bool:
        """work(*args) for one sequence; an exception fails its request only."""
        rid = seq.group.request_id
        if rid in failed:
            return False
        try:
            work(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - reported to that request's caller
            failed[rid] = exc
            return False

    def _fail(self, errors: dict[str, Exception], outputs: list[RequestOutput]) -> "StepFailed":
        for request_id in errors:
            self.abort_request(request_id)  # frees its blocks; the others carry on
        return StepFailed(errors, outputs)

    def _fork_finished_prompts(self, sample_seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """n > 1: once the prompt is computed, the first sequence is forked
        into n - 1 more that share its blocks; all sample from its logits row."""
        seqs, rows = list(sample_seqs), list(range(len(sample_seqs)))
        for row, seq in enumerate(sample_seqs):
            req = seq.group
            if req.params.n > len(req.seqs):
                for j in range(len(req.seqs), req.params.n):
                    child = Sequence(req, j, list(seq.token_ids), f"{req.request_id}#{j}")
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.prefill_target = seq.prefill_target
                    # the parent has sampled nothing yet: a copy of its matcher is a fresh one
                    child.matcher = seq.matcher.deep_copy() if seq.matcher is not None else None
                    self._init_output_state(child)
                    req.seqs.append(child)
                    self.scheduler.fork(seq, child)
                    seqs.append(child)
                    rows.append(row)
        return seqs, rows

    def _init_output_state(self, seq: Sequence) -> None:
        from paged.core.models.tokenizer import IncrementalDetokenizer

        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.group.prompt_token_ids, seq.params.skip_special_tokens)

    def _emit(self, seq: Sequence, sampled, span: range, draft, decoding: bool, now: float) -> None:
        """Appends what a sequence's rows sampled: one token, or with drafts
        the accepted run (core/engine/spec_decode.py) after rolling back the
        rejected drafts' slots; stops at the first token that finishes it."""
        tokens = [sampled.token_ids[r] for r in span]
        if draft:
            tokens = accept(tokens, draft)
            self.scheduler.rollback(seq, len(draft) + 1 - len(tokens))
        if self.spec_stats is not None and (draft or decoding):
            self.spec_stats.record(len(draft or ()), len(tokens))
        for token, r in zip(tokens, span):
            self._append_token(seq, token, sampled.logprobs[r], sampled.chosen_logprobs[r], now)
            if seq.finished:
                return

    def _append_token(self, seq: Sequence, token: int, lp, chosen_lp, now: float) -> None:
        req, p = seq.group, seq.params
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.num_generated_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += chosen_lp
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # the mask allowed it, so the grammar needs text this vocabulary cannot write
            error = seq.matcher.get_error().strip().splitlines()[0]
            raise GrammarError(f"structured_outputs: expected a constraint this model's vocabulary can write, "
                               f"got one it cannot continue after {seq.num_output_tokens - 1} tokens ({error})")
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        if can_stop and ((token in self.stop_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            self._finish(seq, "stop", token)
            return
        delta = seq.detok.add(token)
        if delta:
            seq.text += delta
            if can_stop and p.stop_strings and self._check_stop_strings(seq, len(delta)):
                return
        if seq.matcher is not None and seq.matcher.is_stopped():
            self._finish(seq, "stop")  # the grammar is complete: nothing but EOS could follow
            return
        if n_out >= req.max_tokens:
            self._finish(seq, "length")

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        text = seq.text
        for stop in seq.params.stop_strings:
            idx = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if idx >= 0:
                seq.text = text[:idx + len(stop)] if seq.params.include_stop_str_in_output else text[:idx]
                self._finish(seq, "stop", stop)
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish(reason, stop_reason)
        self.scheduler.finish_seq(seq)
        if seq.group.finished:
            seq.group.metrics.finished_time = time.time()
            self.num_finished += 1

    def _add_prompt_logprobs(self, e, logits: torch.Tensor) -> None:
        """Row r of a prompt chunk predicts prompt token start + r + 1."""
        req = e.seq.group
        if e.seq.index != 0 or len(req.prompt_logprobs) >= len(req.prompt_token_ids):
            return
        lps = torch.log_softmax(logits, dim=-1)
        k = req.params.prompt_logprobs
        for r in range(logits.shape[0]):
            pos = e.start + r + 1
            if pos >= len(req.prompt_token_ids):
                break
            if pos == len(req.prompt_logprobs):
                req.prompt_logprobs.append(top_logprobs(lps[r], k, req.prompt_token_ids[pos]))

    # -- reporting ---------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.scheduler.stats()
        kv = self.kv_cache_manager.stats()
        s.update(
            kv_cache=kv,
            kv_cache_usage=kv.get("usage", 0.0),
            prefix_cache_hit_rate=kv.get("hit_rate", 0.0),
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            num_finished=self.num_finished,
        )
        if self.spec_stats is not None:
            s.update(self.spec_stats.as_dict())
        if self.scheduler.prefill_budget is not None:
            s.update(self.scheduler.prefill_budget.stats())
        return s
