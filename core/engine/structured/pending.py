"""Requests whose constraint is still compiling, held back from the scheduler.

The engine hands every constrained request here first. A constraint compiled
before (the server compiles on its own thread before it submits) is a cache
hit: the request gets its matcher and goes straight on. Otherwise it waits
here while the compile thread works, and the engine keeps stepping the other
requests; each step admits the requests whose compilation has finished.

    grammars = PendingGrammars(compiler)
    if grammars.hold(req): ...          # True: compiling, admit later
    ready, failed = grammars.collect()  # finished compilations
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Optional

from paged.core.engine.structured.compiler import GrammarCompiler


class PendingGrammars:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._pending: dict[str, tuple[object, Future]] = {}  # request id -> (Request, its compilation)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def hold(self, req) -> bool:
        """Gives req's first sequence its matcher when the constraint is
        compiled (False: schedule it now); else starts the compilation and
        keeps req (True). A constraint known to fail raises GrammarError."""
        template = self.compiler.cached(req.params.structured_outputs)
        if template is not None:
            req.seqs[0].matcher = template.deep_copy()
            return False
        self._pending[req.request_id] = (req, self.compiler.submit(req.params.structured_outputs))
        return True

    def collect(self) -> tuple[list, dict[str, Exception]]:
        """The requests whose compilation ended: (ready ones, matcher set;
        {request id: error} for the failed ones)."""
        ready, failed = [], {}
        for rid, (req, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            if future.exception() is not None:
                failed[rid] = future.exception()
            else:
                req.seqs[0].matcher = future.result().deep_copy()
                ready.append(req)
        return ready, failed

    def abort(self, request_id: str) -> Optional[object]:
        """Drops a held request (its compilation finishes unused and is cached)."""
        held = self._pending.pop(request_id, None)
        return None if held is None else held[0]

    def wait(self, timeout: float) -> None:
        """Blocks until a compilation ends or `timeout` s pass (an engine
        with nothing else to run, instead of spinning)."""
        if self._pending:
            wait([f for _, f in self._pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)
