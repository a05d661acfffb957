"""core/models/elementwise.py: sigmoid and tanh whose value for an element
does not depend on the tensor around it (torch's own CPU loops round the
vector body and the scalar tail of a range differently, and split large
tensors across threads by size). Oracle: the same function on the element
alone; and torch's function within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from paged.core.models import elementwise


@pytest.mark.parametrize("name", ["sigmoid", "tanh"])
def test_an_elements_value_does_not_depend_on_its_tensor(name):
    fn, ref = getattr(elementwise, name), getattr(torch, name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70_000, generator=gen) * 6
    x[:4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    alone = torch.cat([fn(x[i:i + 1]) for i in range(0, 3000)])
    whole = fn(x)
    assert torch.equal(whole[:3000], alone)
    for size in (2, 7, 13, 64, 65, 777):  # sizes around the vector steps and the tail
        got = torch.cat([fn(x[s:s + size].clone()) for s in range(0, 2000, size)])
        assert torch.equal(got, alone[:got.numel()]), size
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(fn(x), whole), t
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(whole, ref(x), rtol=1e-6, atol=1e-7)
    rows = x[:6 * 50].view(6, 50)
    assert fn(rows).shape == rows.shape and torch.equal(fn(rows).reshape(-1), whole[:300])


def test_empty_and_other_dtypes():
    assert elementwise.sigmoid(torch.empty(0, 3)).shape == (0, 3)
    y = elementwise.tanh(torch.linspace(-3, 3, 11, dtype=torch.float64))
    assert y.dtype == torch.float64 and torch.allclose(y, torch.tanh(torch.linspace(-3, 3, 11, dtype=torch.float64)))
