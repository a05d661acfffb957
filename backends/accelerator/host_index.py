"""A step's index arrays on the host, for the accelerators' per-step
metadata (CudaBackend, NpuBackend): their block-id checks and the lengths
the launches / operators need are read here, never from the device.

The model runner built those arrays on the host and sends them to the
device itself; it hands the host copies along (``common.host``, a
HostBatch, core/engine/model_runner.py), so a runner step reads them
without any device->host copy. A caller that made the metadata itself
(tests, the conformance suite, a contract op) has device tensors only: they
come back in ONE device->host copy (one sync), not one per array.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.backends.base import AttentionMetadata
from paged.backends.reference import validation as v

_NAMES = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")


@dataclass(frozen=True)
class HostIndex:
    """Host (CPU) tensors of a step's index arrays."""

    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, W]
    device_copies: int  # device->host copies it took: 0 from the runner's host arrays, else 1


def host_index(common: AttentionMetadata) -> HostIndex:
    """The step's index arrays on the host: the runner's own host copies
    when it attached them, else one device->host copy of all four."""
    batch = getattr(common, "host", None)
    if batch is not None:
        return HostIndex(*(torch.from_numpy(getattr(batch, n)) for n in _NAMES), device_copies=0)
    parts = [getattr(common, n) for n in _NAMES]
    if all(p.device.type == "cpu" for p in parts):
        return HostIndex(*parts, device_copies=0)
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).cpu()  # the one sync
    out, start = [], 0
    for p in parts:
        out.append(flat[start:start + p.numel()].view(p.shape).to(p.dtype))
        start += p.numel()
    return HostIndex(*out, device_copies=1)


def check_step_ids(block_size: int, host: HostIndex, num_decodes: int, num_blocks: int) -> None:
    """The step's block ids against a cache of ``num_blocks`` blocks, as the
    contract ops check them (IndexError / ValueError naming the value):
    slots, every sequence's block table, the prefill rows' query_start_loc."""
    v.check_slots("slot_mapping", host.slot_mapping, num_blocks * block_size)
    v.check_block_tables(_BlockSize(block_size), host.block_tables, host.seq_lens, num_blocks)
    qsl, nd = host.query_start_loc, num_decodes
    if nd < host.seq_lens.shape[0]:
        v.check_query_start_loc(qsl[nd:] - qsl[nd], int(qsl[-1] - qsl[nd]), host.seq_lens[nd:])


@dataclass(frozen=True)
class _BlockSize:
    block_size: int  # what check_block_tables reads of a backend
