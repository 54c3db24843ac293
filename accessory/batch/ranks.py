"""How the ranks of a job that plans on one rank hear of each other: work done on rank 0 alone, any rank's failure
stopping every rank with one message, and each data-parallel group's share sent to its ranks. The collectives
themselves are ParallelContext's."""
from __future__ import annotations

from typing import Callable, Optional

from accessory.parallel.context import GroupLayout, ParallelContext


def on_rank0(world: ParallelContext, fn: Callable):
    """fn() on the group's rank 0 alone (None elsewhere); if it raises, every rank stops (see `everyone_agrees`)."""
    result, error = None, None
    if world.rank == 0:
        try:
            result = fn()
        except Exception as e:  # every rank must hear of it, or the others would wait forever
            error = e
    everyone_agrees(world, error)
    return result


def everyone_agrees(world: ParallelContext, error: Optional[Exception]) -> None:
    """Collective over `world`'s group: if any rank failed, every rank stops. The failing rank raises its error (the CLI
    logs it and exits 2); the others exit 2 quietly, so the user reads one message, not one per rank."""
    failed = world.all_gather_object(None if error is None else str(error))
    if error is not None:
        raise error
    if any(failed):
        raise SystemExit(2)


def scatter_to_groups(world: ParallelContext, layout: GroupLayout, per_group: Optional[list]) -> list:
    """Every rank gets its data-parallel group's item of rank 0's `per_group` (None on the other ranks): the
    non-source ranks of a group need its jobs too, they decode alongside."""
    per_rank = [per_group[rank // layout.mp_size] for rank in range(world.world_size)] if per_group else None
    return world.scatter_object(per_rank)
