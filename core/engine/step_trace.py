"""One JSON line per engine step, to see where serving time goes:
``PAGED_STEP_TRACE=/tmp/steps.jsonl paged serve ...`` (or any engine), then
``python benchmarks/step_trace.py /tmp/steps.jsonl`` for the summary
(docs/engine.md, "Tracing steps").

A line: ``{"start": epoch seconds, "step_s": the whole Engine.step,
"forward_s": forward + sampling (what the prefill budget learns from),
"decode_rows": rows that generate a token, "prompt_rows": prompt rows,
"seqs": sequences}``. Lines are written as they come (line buffered: a
trace survives a killed server); a path that cannot be opened is a warning,
never a failed engine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

log = logging.getLogger("paged.step_trace")

ENV = "PAGED_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def record(self, started: float, step_s: float, forward_s: float, decode_rows: int, prompt_rows: int,
               seqs: int) -> None:
        self._file.write(json.dumps({"start": round(started, 6), "step_s": round(step_s, 6),
                                     "forward_s": round(forward_s, 6), "decode_rows": decode_rows,
                                     "prompt_rows": prompt_rows, "seqs": seqs}) + "\n")

    def close(self) -> None:
        self._file.close()


def from_env() -> Optional[StepTrace]:
    """The trace PAGED_STEP_TRACE names, or None (unset, empty, or not writable)."""
    path = os.environ.get(ENV, "")
    if not path:
        return None
    try:
        trace = StepTrace(path)
    except OSError as exc:
        log.warning("%s=%s: cannot write the step trace (%s); not tracing", ENV, path, exc)
        return None
    log.info("tracing every step to %s (%s)", path, ENV)
    return trace


def now() -> float:
    """Epoch seconds, the clock of a line's "start"."""
    return time.time()
