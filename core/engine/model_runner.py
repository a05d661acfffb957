"""Runs one scheduled step through the model.

Per step it builds the flat inputs once, with numpy (no per-token Python
loops): token ids, positions, slot_mapping (slot = block_table[pos // bs] * bs
+ pos % bs), padded int32 block tables, seq_lens, query_start_loc, then the
attention backend's per-step metadata from them (``build_metadata``); performs
the step's copy-on-write block copies; runs the model under
torch.inference_mode(); and computes logits only for the rows that sample
(the last token of every sequence whose step reaches its last known token,
and with speculative decoding every draft row after it),
plus the prompt rows of requests that asked for prompt_logprobs.

Host to device: on the CPU the step's tensors are the numpy arrays
themselves (no copy). On an accelerator every array of the step goes in ONE
copy (``to_device``): packed into one page-locked host buffer and copied
with ``non_blocking=True``, so the host never waits for the device's queued
work (a copy from pageable memory with non_blocking=False waits for the
whole stream, once per array). The host arrays travel with the metadata
(``StepMetadata.host``) so a backend reads lengths and ids there instead of
copying them back.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from paged.backends.base import AttentionMetadata

from paged.core.engine.request import Request, Sequence
from paged.core.engine.sampling_params import SamplingParams
from paged.core.engine.scheduler import ScheduledSeq, SchedulerOutput
from paged.core.engine.spec_decode import draft_rows

log = logging.getLogger("paged.engine")


@dataclass
class HostBatch:
    """A step's flat inputs as host arrays: all a rank needs to run it
    (tensor parallelism broadcasts this from rank 0; it pickles small)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    num_decodes: int
    sample_rows: np.ndarray  # row of the last token of each sampling sequence
    first_prompt_row: int  # rows before it generate a token (decodes, verifies), prompt rows from it
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # (first row, rows) per prompt_logprobs entry
    copies: list = field(default_factory=list)  # copy-on-write (src, dst) block pairs


@dataclass
class StepMetadata(AttentionMetadata):
    """The common metadata of a runner step, with the host arrays it was
    made from: a backend's ``build_metadata`` reads lengths and block ids
    there (backends/accelerator/host_index.py) instead of copying them back
    from the device."""

    host: Optional[HostBatch] = field(default=None, kw_only=True)


#: bytes each array starts at in the staging buffer: every device view of it
#: is aligned as a fresh allocation's first 16 bytes would be
_STAGING_ALIGN = 16


@functools.lru_cache(maxsize=None)
def _can_pin() -> bool:
    """Whether this torch can page-lock host memory (an accelerator runtime
    is present); a CPU-only build cannot."""
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return False
    return True


def _staging_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer for one step's arrays: page-locked where possible, so
    the copy is a DMA the host does not wait for. Pinned blocks come from
    torch's caching host allocator, which keeps a block until the copies
    recorded on it have finished, so reusing it for a later step is safe."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=_can_pin())


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays as tensors on ``device`` in one host->device copy,
    issued with non_blocking=True (from page-locked memory when the runtime
    can pin): every array packed into one staging buffer, each device
    tensor a view of the one copy. On the CPU: the arrays themselves."""
    if device.type == "cpu":
        return {name: torch.from_numpy(a) for name, a in arrays.items()}
    offsets, total = {}, 0
    for name, a in arrays.items():
        offsets[name] = total
        total += -(-a.nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
    host = _staging_buffer(max(total, _STAGING_ALIGN))
    flat = host.numpy()
    for name, a in arrays.items():
        flat[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return {name: dev[offsets[name]:offsets[name] + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for name, a in arrays.items()}


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: np.ndarray  # row of the last token of each sampling sequence
    sample_seqs: list[Sequence]
    prompt_lp: list[tuple[ScheduledSeq, int]] = field(default_factory=list)  # (entry, first row)
    batch: Optional[HostBatch] = None
    device_sample_rows: Optional[torch.Tensor] = None  # sample_rows on the device (sent with the step's inputs)


@dataclass
class StepResult:
    sample_seqs: list[Sequence]
    logits: Optional[torch.Tensor]  # float32 [len(sample_seqs), vocab]
    # prompt_logprobs requests: (entry, logits of its chunk's rows [n, vocab])
    prompt_logits: list[tuple[ScheduledSeq, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    """The step's flat inputs and the model call over one KV cache; made by
    the Worker (core/engine/worker.py) once it has sized and allocated the cache."""

    def __init__(self, model, attn_backend, num_layers: int, num_blocks: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.backend = attn_backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.kv_caches = attn_backend.allocate_kv_cache(num_layers, num_blocks)
        self._key_caches = [k for k, _ in self.kv_caches]
        self._value_caches = [v for _, v in self.kv_caches]

    # -- inputs -------------------------------------------------------------------
    def build_inputs(self, out: SchedulerOutput, tables: list[list[int]]) -> StepInputs:
        inp = self._build(out.scheduled, tables, len(out.decodes))
        inp.batch.copies = list(out.copies)
        return inp

    def _build(self, entries: list[ScheduledSeq], tables: list[list[int]], num_decodes: int) -> StepInputs:
        bs = self.block_size
        num_seqs = len(entries)
        lens = np.fromiter((e.num_new_tokens for e in entries), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((e.start for e in entries), dtype=np.int64, count=num_seqs)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        total = int(qsl[-1])
        seq_lens = starts + lens

        ids: list[int] = []
        for e in entries:
            toks = e.seq.token_ids
            if e.num_new_tokens == 1:
                ids.append(toks[e.start])
            else:
                ids.extend(e.new_token_ids())

        row_seq = np.repeat(np.arange(num_seqs), lens)
        positions = np.arange(total, dtype=np.int64) - qsl[row_seq] + starts[row_seq]

        width = max(1, int(-(-seq_lens.max() // bs)) if num_seqs else 1)
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, t in enumerate(tables):
            n = min(len(t), width)
            block_tables[i, :n] = t[:n]
        slot_mapping = block_tables[row_seq, positions // bs].astype(np.int64) * bs + positions % bs

        samples = [i for i, e in enumerate(entries) if e.samples]
        prompt_lp = [i for i, e in enumerate(entries)
                     if i >= num_decodes and not e.draft and e.seq.group.params.prompt_logprobs is not None]
        # rows that generate a token come first: decodes, verifies, then recomputed generated tokens
        # (the scheduler's order); prompt rows from the first chunk inside its original prompt on
        generating = next((i for i in range(num_decodes, num_seqs) if entries[i].in_prompt), num_seqs)
        batch = HostBatch(np.asarray(ids, dtype=np.int64), positions, slot_mapping, qsl.astype(np.int32),
                          seq_lens.astype(np.int32), block_tables, num_decodes,
                          draft_rows(qsl[1:][samples] - 1, [entries[i].draft for i in samples]), int(qsl[generating]),
                          [(int(qsl[i]), entries[i].num_new_tokens) for i in prompt_lp])
        return self.inputs_from(batch, [entries[i].seq for i in samples], [entries[i] for i in prompt_lp])

    def inputs_from(self, b: HostBatch, sample_seqs: Optional[list[Sequence]] = None,
                    prompt_entries: Optional[list] = None) -> StepInputs:
        """The device inputs of a host batch (one host->device copy,
        ``to_device``); a tensor-parallel follower has no sequences (its
        logits are rank 0's to sample)."""
        num_seqs = len(b.seq_lens)
        t = to_device({"slot_mapping": b.slot_mapping, "query_start_loc": b.query_start_loc,
                       "seq_lens": b.seq_lens, "block_tables": b.block_tables, "input_ids": b.input_ids,
                       "positions": b.positions, "sample_rows": np.asarray(b.sample_rows, dtype=np.int64)},
                      self.device)
        common = StepMetadata(
            slot_mapping=t["slot_mapping"],
            query_start_loc=t["query_start_loc"],
            seq_lens=t["seq_lens"],
            block_tables=t["block_tables"],
            num_decodes=b.num_decodes,
            max_query_len=int(np.diff(b.query_start_loc).max()) if num_seqs else 0,
            max_seq_len=int(b.seq_lens.max()) if num_seqs else 0,
            first_prompt_row=b.first_prompt_row,
            host=b,
        )
        # Once per step: what the backend derives from it (launch sizes, host
        # lists, masks) is shared by every layer.
        meta = self.backend.build_metadata(common)
        entries = prompt_entries or [None] * len(b.prompt_rows)
        return StepInputs(
            input_ids=t["input_ids"],
            positions=t["positions"],
            meta=meta,
            sample_rows=b.sample_rows,
            sample_seqs=sample_seqs or [],
            prompt_lp=[(e, r) for e, (r, _) in zip(entries, b.prompt_rows)],
            batch=b,
            device_sample_rows=t["sample_rows"],
        )

    # -- one step -------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, tables: list[list[int]]) -> StepResult:
        return self.run(self.build_inputs(out, tables))

    def run_model(self, inp: StepInputs) -> torch.Tensor:
        """The model over one step's inputs -> hidden states [T, hidden]. A
        platform's runner overrides it to replay a captured graph instead
        (backends/cuda/graphs.py: CUDA graphs for decode steps)."""
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

    @torch.inference_mode()
    def run(self, inp: StepInputs) -> StepResult:
        """The step's block copies, the model, and (host) logits of the
        sampling rows and of the prompt_logprobs rows."""
        copies = inp.batch.copies
        if copies:
            # on the host: a backend checks it there and moves it without a sync (its copy_blocks)
            mapping = torch.tensor(copies, dtype=torch.int64)
            self.backend.copy_blocks(self._key_caches, self._value_caches, mapping)
        hidden = self.run_model(inp)
        logits = None
        if len(inp.sample_rows):
            rows = inp.device_sample_rows
            if rows is None:  # inputs made without inputs_from
                rows = torch.from_numpy(inp.sample_rows).to(self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).cpu()  # float32 already
        prompt_logits = [(e, self.model.compute_logits(hidden[r:r + n]).cpu())
                         for (e, r), (_, n) in zip(inp.prompt_lp, inp.batch.prompt_rows)]
        return StepResult(inp.sample_seqs, logits, prompt_logits)

    @torch.inference_mode()
    def warm_up(self, prompt_len: int = 16) -> None:
        """One prefill and one decode through free blocks, so the first
        request does not pay for lazy initialisation. The blocks' contents
        are garbage afterwards; nothing reads a block before writing it."""
        need = -(-(prompt_len + 1) // self.block_size)
        if need > self.num_blocks:
            return
        table = list(range(need))
        seq = Request("warm-up", None, [0] * (prompt_len + 1), SamplingParams(max_tokens=1)).seqs[0]
        for entry, nd in ((ScheduledSeq(seq, 0, prompt_len), 0), (ScheduledSeq(seq, prompt_len, 1), 1)):
            self.run(self._build([entry], [table], nd))
