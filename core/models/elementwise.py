"""Elementwise torch functions (sigmoid, tanh) whose value for an element
does not depend on the tensor around it: the batch invariance of the
routers and gates the models compute in torch.

torch's CPU loops run whole vectors (two of them a step), then the rest of
the range one element at a time, and a large tensor is split across threads
at boundaries that follow its size; the vector and scalar code of sigmoid
or tanh round differently, so an element's value changed with how many rows
lay beside it (1 ulp in a qwen2moe shared-expert gate made a prompt row's
logits differ when the prompt was prefilled in chunks). ``invariant``
copies the elements into a buffer of whole vector steps and runs the
function over it in slices small enough that one thread takes each: every
element goes through the same vector code. Other devices run the function
as it is (their kernels' invariance is theirs)."""

from __future__ import annotations

from typing import Callable

import torch

#: elements: a multiple of any CPU vector loop's step (two 16-float vectors)
ALIGN = 64
#: elements per call: below torch's grain size (32768), so one thread runs each slice
SLICE = 1 << 14


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise ``fn`` (same shape and dtype), each element's
    value independent of x's size and of the thread count."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    n = x.numel()
    buf = torch.zeros(-(-n // ALIGN) * ALIGN, dtype=x.dtype)
    buf[:n] = x.reshape(-1)
    out = torch.empty_like(buf)
    for s in range(0, buf.numel(), SLICE):
        out[s:s + SLICE] = fn(buf[s:s + SLICE])
    return out[:n].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.sigmoid, x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return invariant(torch.tanh, x)
