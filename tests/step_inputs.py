"""Model steps as the model runner builds them, for tests that call a
model's forward directly (the layer stack against the Python layers,
tensor-parallel ranks against one process)."""

from __future__ import annotations

import torch

from paged.backends.base import AttentionMetadata

BLOCK = 16
MAX_BLOCKS = 4  # per sequence: 64 tokens

# prompts of 3, 17, 9, 30 and 5 tokens (+ generated ones)
LENGTHS = [3, 17, 9, 30, 5]
#: (name, [(sequence, start, count)], number of decodes): chunked prefill on a
#: cached prefix beside decodes, decode batches of 5 and 1, a late prefill
SCENARIO = [
    ("prefill, seq 3 chunked", [(0, 0, 3), (1, 0, 17), (2, 0, 9), (3, 0, 20), (4, 0, 5)], 0),
    ("mixed: 4 decodes + prefill on a cached prefix", [(0, 3, 1), (1, 17, 1), (2, 9, 1), (4, 5, 1), (3, 20, 10)], 4),
    ("decode batch of 5", [(0, 4, 1), (1, 18, 1), (2, 10, 1), (3, 30, 1), (4, 6, 1)], 5),
    ("decode batch of 1", [(2, 11, 1)], 1),
    ("prefill only after a decode-free restart", [(1, 19, 6)], 0),
]


def step(tokens: list[list[int]], work: list[tuple[int, int, int]], num_decodes: int,
         mark_prompt_rows: bool = False):
    """work: (seq, start, count) per sequence, decodes first; sequence s owns
    blocks s*MAX_BLOCKS ... -> (input_ids, positions, meta). With
    ``mark_prompt_rows`` the rows after the decodes are prompt rows
    (meta.first_prompt_row), as the runner marks them."""
    ids, pos, slots, qsl = [], [], [], [0]
    for s, start, n in work:
        ids += tokens[s][start:start + n]
        pos += range(start, start + n)
        slots += [(s * MAX_BLOCKS + p // BLOCK) * BLOCK + p % BLOCK for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
    tables = [[s * MAX_BLOCKS + b for b in range(MAX_BLOCKS)] for s, _, _ in work]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([st + n for _, st, n in work], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), num_decodes=num_decodes,
        max_query_len=max(n for *_, n in work), max_seq_len=max(st + n for _, st, n in work))
    if mark_prompt_rows:
        meta.first_prompt_row = num_decodes
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta
