"""A minimal progress bar on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``with ProgressBar(total, "loading") as bar: bar.update(n)``.

    Disabled (no output at all) when ``quiet`` is true or the stream is not a
    TTY, so logs and pipes stay clean. Redraws at most ~10 times a second.
    """

    def __init__(self, total: float, desc: str = "", unit: str = "", *, quiet: bool = False,
                 stream: TextIO | None = None, width: int = 30):
        self.total = max(float(total), 1e-9)
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and _isatty(self.stream)
        self.width = width
        self.done = 0.0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: float = 1) -> None:
        self.done += n
        if self.enabled and (time.monotonic() - self._last_draw > 0.1 or self.done >= self.total):
            self._draw()

    def _draw(self) -> None:
        self._last_draw = time.monotonic()
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        amount = _fmt(self.done, self.unit) + "/" + _fmt(self.total, self.unit)
        self.stream.write(f"\r{self.desc} [{bar}] {frac * 100:5.1f}% {amount} "
                          f"{time.monotonic() - self._start:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _fmt(value: float, unit: str) -> str:
    if unit == "B":
        for suffix in ("B", "KB", "MB", "GB"):
            if value < 1024 or suffix == "GB":
                return f"{value:.0f}{suffix}" if suffix == "B" else f"{value:.1f}{suffix}"
            value /= 1024
    return f"{value:.0f}{unit}"
