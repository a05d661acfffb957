"""LLM(...) takes what the process imported out of the collector's
generations (gc.freeze, core/llm.py), but not what its engine builds: the
engine's objects stay collectable (an LLM dropped without close() can be
freed even where it holds reference cycles)."""

import gc
import os

from paged.core.llm import LLM


def tracked(obj) -> bool:
    """In one of the collector's generations (frozen objects are in none)."""
    return any(o is obj for o in gc.get_objects())


def test_llm_freezes_what_came_before_but_not_its_engine(default_model_path):
    gc.unfreeze()
    try:
        before = [[]]  # a container made before the LLM
        assert tracked(before)
        llm = LLM(str(default_model_path), device="cpu", max_model_len=256, kv_cache_memory="64MiB",
                  cpu_threads_bind=str(min(os.sched_getaffinity(0))))
        assert gc.get_freeze_count() > 0 and not tracked(before)
        assert tracked(llm.engine) and tracked(llm.engine.scheduler)
        llm.close()
    finally:
        gc.unfreeze()
