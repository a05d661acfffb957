"""What a platform's kernels accept and guarantee: its binding declaration.

``Platform.capabilities()`` returns one ``Capabilities``. Two things read it:

- the engine, at start, before it loads the model: a block size, dtype or
  head size outside the declaration is refused with one line
  (``check``), so a platform cannot pass conformance on a smaller set
  than it is asked to run;
- the conformance suite (core/conformance): every check runs on sizes the
  declaration accepts (``block_size_near``, ``head_size_near``), and batch
  invariance is asserted where declared (``invariant``) and otherwise
  reported as the measured difference.

The default (base Platform) accepts every positive block and head size in
its supported dtypes and guarantees invariance on every path: what the CPU
kernels and the reference backend do, and what the suite asked of everyone
before declarations existed.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.core.argcheck import fail

#: the paths whose batch invariance a platform may guarantee, per dtype:
#: decode / prefill = the attention kernels, bitwise, a sequence alone vs in
#: any batch; engine = greedy tokens through the engine, alone vs batched
PATHS = ("decode", "prefill", "engine")


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rule(multiple: int, lo: int, hi: int | None) -> str:
    step = "any size" if multiple == 1 else f"a multiple of {multiple}"
    return f"{step} in [{lo}, {hi}]" if hi else f"{step} >= {lo}"


@dataclass(frozen=True)
class Capabilities:
    dtypes: tuple  # torch dtypes the kernels run, best first
    block_size_multiple: int = 1
    max_block_size: int | None = None
    head_size_multiple: int = 1
    max_head_size: int | None = None
    #: the only head sizes accepted, where kernels are instantiated per size (the rule above is then unused)
    head_sizes: tuple | None = None
    #: dtype name -> the PATHS with guaranteed batch invariance; None: all
    #: paths in every dtype; {} : none anywhere
    batch_invariant: dict | None = None

    # -- sizes -------------------------------------------------------------
    def accepts_block_size(self, n: int) -> bool:
        return _accepts(n, self.block_size_multiple, self.max_block_size)

    def accepts_head_size(self, n: int) -> bool:
        if self.head_sizes is not None:
            return n in self.head_sizes
        return _accepts(n, self.head_size_multiple, self.max_head_size)

    def block_size_near(self, n: int) -> int:
        """The accepted block size closest above ``n`` (the largest accepted
        one past the maximum): how the suite adapts a case it wants."""
        return _near(n, self.block_size_multiple, self.max_block_size)

    def head_size_near(self, n: int) -> int:
        if self.head_sizes is not None:
            return min((h for h in self.head_sizes if h >= n), default=max(self.head_sizes))
        return _near(n, self.head_size_multiple, self.max_head_size)

    def _head_rule(self) -> str:
        if self.head_sizes is not None:
            return "one of " + ", ".join(map(str, self.head_sizes))
        return _rule(self.head_size_multiple, self.head_size_multiple, self.max_head_size)

    # -- invariance ----------------------------------------------------------
    def invariant(self, dtype, path: str) -> bool:
        if path not in PATHS:
            fail("path", "one of " + ", ".join(PATHS), repr(path))
        if self.batch_invariant is None:
            return True
        return path in self.batch_invariant.get(dtype_name(dtype), ())

    # -- the binding check -----------------------------------------------------
    def check(self, platform: str, *, block_size: int | None = None, dtype=None,
              head_size: int | None = None) -> None:
        """ValueError (one line, ``name: expected X, got Y``) for the first
        value outside the declaration; None values are not checked."""
        if dtype is not None and dtype not in self.dtypes:
            fail(f"--dtype on {platform}", "one of " + ", ".join(map(dtype_name, self.dtypes)), dtype_name(dtype))
        if block_size is not None and not self.accepts_block_size(block_size):
            fail(f"--block-size on {platform}",
                 _rule(self.block_size_multiple, self.block_size_multiple, self.max_block_size), block_size)
        if head_size is not None and not self.accepts_head_size(head_size):
            fail(f"the model's head size on {platform}", self._head_rule(), head_size)

    def to_json(self) -> dict:
        """What the conformance report lists."""
        names = [dtype_name(d) for d in self.dtypes]
        inv = self.batch_invariant
        return {"dtypes": names,
                "block_sizes": _rule(self.block_size_multiple, self.block_size_multiple, self.max_block_size),
                "head_sizes": self._head_rule(),
                "batch_invariant": {n: list(PATHS) if inv is None else list(inv.get(n, ())) for n in names}}


def _accepts(n: int, multiple: int, hi: int | None) -> bool:
    return isinstance(n, int) and n >= multiple and n % multiple == 0 and (hi is None or n <= hi)


def _near(n: int, multiple: int, hi: int | None) -> int:
    up = max(multiple, -(-n // multiple) * multiple)
    return up if hi is None or up <= hi else hi // multiple * multiple
