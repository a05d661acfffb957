"""A tensor-parallel rank other than 0: receives rank 0's EngineConfig,
builds the same engine (the Worker loads this rank's shard and takes part in
every collective of start-up: block count, warm-up), then runs rank 0's
steps until it ends the group (docs/distributed.md)."""

from __future__ import annotations

from paged.core.engine.distributed.group import RankGroup, join_torchrun
from paged.core.engine.engine import Engine


def follow(group: RankGroup) -> None:
    """Joined rank ``group.rank``: build, then follow rank 0."""
    config = group.broadcast_object()
    engine = Engine(config, group=group)
    try:
        engine.worker.follow()
    finally:
        group.shutdown(grace_s=0)


def follow_torchrun(backend: str) -> int:
    """``paged <command>`` started by torchrun with RANK > 0: joins, follows."""
    follow(join_torchrun(backend))
    return 0
