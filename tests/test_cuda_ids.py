"""CUDA backend block-id checks, on the CPU (no GPU needed): the model runner
builds every step's index tensors under torch.inference_mode(), whose
tensors have no version counter; the checks must work on them (they crashed
with 'Inference tensors do not track version counter'), and a step's ids are
checked once on the host where its metadata is built."""

from __future__ import annotations

import pytest
import torch

from paged.backends.base import AttentionMetadata
from paged.backends.cuda.id_checks import CheckedOnce
from paged.backends.accelerator.host_index import check_step_ids, host_index


def test_checked_once_accepts_inference_tensors_and_never_memoizes_them():
    with torch.inference_mode():
        tables = torch.arange(12, dtype=torch.int32).view(3, 4)
        calls = []
        once = CheckedOnce()
        for _ in range(3):  # no version counter: an in-place change could not be seen
            once.run("t", (tables,), (16,), lambda: calls.append(1))
        assert len(calls) == 3
        tables[0, 0] = 99  # and one is caught after an in-place write

        def check():
            if int(tables.max()) >= 16:
                raise IndexError("block 99")
        with pytest.raises(IndexError):
            once.run("t", (tables,), (16,), check)
    normal = torch.zeros(3, dtype=torch.int32)  # ordinary tensors are still remembered
    calls = []
    for _ in range(3):
        once.run("n", (normal,), (1,), lambda: calls.append(1))
    assert len(calls) == 1


def _step(block_tables, seq_lens, slots, qsl, num_decodes):
    with torch.inference_mode():  # as the model runner builds them
        return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64),
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 block_tables=torch.tensor(block_tables, dtype=torch.int32),
                                 num_decodes=num_decodes, max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
                                 max_seq_len=max(seq_lens))


def test_step_ids_checked_on_the_host():
    bs = 4
    # one decode (len 5: blocks 2, 3) and one 3-token prefill (len 3: block 1); padding slot -1
    good = dict(block_tables=[[2, 3], [1, 0]], seq_lens=[5, 3], slots=[12, 4, 5, -1], qsl=[0, 1, 4],
                num_decodes=1)
    check_step_ids(bs, host_index(_step(**good)), 1, num_blocks=4)
    with pytest.raises(IndexError, match=r"block_tables\[0, 1\].*\[0, 4\).*got 7"):
        check_step_ids(bs, host_index(_step(**{**good, "block_tables": [[2, 7], [1, 0]]})), 1, num_blocks=4)
    check_step_ids(bs, host_index(_step(**{**good, "block_tables": [[2, 3], [1, 9]]})), 1, num_blocks=4)  # past seq 1's used blocks
    with pytest.raises(IndexError, match=r"slot_mapping\[2\].*got 16"):
        check_step_ids(bs, host_index(_step(**{**good, "slots": [12, 4, 16, -1]})), 1, num_blocks=4)
    with pytest.raises(ValueError, match=r"query tokens of sequence 0"):  # prefill longer than its sequence
        check_step_ids(bs, host_index(_step(**{**good, "seq_lens": [5, 2]})), 1, num_blocks=4)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        check_step_ids(bs, host_index(_step(**{**good, "seq_lens": [5, 0]})), 1, num_blocks=4)
