"""Launch sizes of the decode kernel, from the step's real lengths.

The decode kernel (csrc_cuda/attention.cu) cuts each sequence's visible
keys into partitions of ``SPLIT_PARTITION`` keys (split-K); a sequence uses
``ceil(visible keys / 512)`` of them whatever else is in the batch, which
keeps its result batch invariant. A launch is ``num_kv_heads x num_seqs x
(row tiles x max_splits)`` CTAs, and the float32 workspace holds
``num_seqs x num_heads x max_splits`` partials: ``max_splits`` must cover
the step's longest sequence, and every partition past a sequence's own
count exits at once. Sizing it by the longest sequence the cache could hold
(the block table's width under CUDA graphs) launched, for a 128k context,
256 partitions per (kv head, sequence) on every decode step; sizing it by
the step's longest sequence launches what the step needs.

CUDA graphs fix the launch at capture, so the graph runner captures one
graph per (batch size, split bucket): ``split_buckets`` (powers of two up
to the largest count) and a step replays the smallest bucket covering its
``decode_splits`` (at most twice the partitions it needs). Pure arithmetic,
tested on the CPU (tests/test_cuda_sizing.py); the kernel's own constant is
``_C_cuda.split_partition`` (a test compares).
"""

from __future__ import annotations

import bisect

#: keys per split-K partition (csrc_cuda/ops.h kSplitPartition)
SPLIT_PARTITION = 512
#: bytes per float32 partial: head_size outputs plus (max, sum)
_FLOAT = 4


def decode_splits(max_seq_len: int, sliding_window: int = 0) -> int:
    """Partitions the decode launch needs for a step whose longest decode
    sequence is ``max_seq_len`` tokens (its query is the last one). A
    window caps the visible keys. At least 1 (an empty step launches one)."""
    keys = int(max_seq_len)
    if sliding_window and 0 < sliding_window < keys:
        keys = int(sliding_window)
    return max(1, -(-keys // SPLIT_PARTITION))


def layer_splits(step_splits: int, step_window: int, layer_window: int) -> int:
    """Partitions a layer with its own sliding window launches in a step
    whose launch (``step_splits``) was sized for ``step_window`` (the
    backend's: the widest of the model's layers, 0 = none): a window caps a
    sequence's visible keys, so a layer of window W needs at most
    ceil(W / 512) whatever the step's lengths; never more than the step's.
    ValueError for a layer wider than the step was sized for (its longer
    sequences would get NaN rows)."""
    step_window, layer_window = int(step_window or 0), int(layer_window or 0)
    if step_window and not 0 < layer_window <= step_window:
        raise ValueError(f"sliding_window of a layer: expected at most the {step_window} the step's decode "
                         f"launch was sized for, got {layer_window or 'none'}")
    return min(step_splits, decode_splits(layer_window)) if layer_window else step_splits


def split_buckets(max_splits: int) -> list[int]:
    """The split counts graphs are captured for: 1, 2, 4, ... below
    ``max_splits``, and ``max_splits`` itself (ascending)."""
    if isinstance(max_splits, bool) or not isinstance(max_splits, int) or max_splits < 1:
        raise ValueError(f"max_splits: expected a positive integer, got {max_splits!r}")
    buckets, b = [], 1
    while b < max_splits:
        buckets.append(b)
        b *= 2
    return buckets + [max_splits]


def bucket_for(splits: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= ``splits`` (ascending ``buckets``); None when
    none covers it (the step runs eagerly)."""
    i = bisect.bisect_left(buckets, splits)
    return buckets[i] if i < len(buckets) else None


def workspace_bytes(num_seqs: int, num_heads: int, splits: int, head_size: int) -> int:
    """Bytes of the split-K workspace (partial outputs and (max, sum)
    pairs); nothing when the launch does not split."""
    return 0 if splits <= 1 else num_seqs * num_heads * splits * (head_size + 2) * _FLOAT


def capped_buckets(max_splits: int, num_seqs: int, num_heads: int, head_size: int, cap_bytes: int) -> list[int]:
    """``split_buckets(max_splits)`` without those whose workspace for
    ``num_seqs`` sequences exceeds ``cap_bytes`` (steps needing more run
    eagerly); never empty: one partition needs no workspace."""
    return [b for b in split_buckets(max_splits) if workspace_bytes(num_seqs, num_heads, b, head_size) <= cap_bytes]
