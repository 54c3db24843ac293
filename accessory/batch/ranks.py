"""How the ranks of a job that plans on one rank share out its work: each data-parallel group's share sent to its
ranks. The collectives, and rank 0's work with any rank's failure stopping every rank (`ParallelContext.on_rank0`,
`raise_if_any_failed`), are ParallelContext's."""
from __future__ import annotations

from typing import Optional

from accessory.parallel.context import GroupLayout, ParallelContext


def scatter_to_groups(world: ParallelContext, layout: GroupLayout, per_group: Optional[list]) -> list:
    """Every rank gets its data-parallel group's item of rank 0's `per_group` (None on the other ranks): the
    non-source ranks of a group need its jobs too, they decode alongside."""
    per_rank = [per_group[rank // layout.mp_size] for rank in range(world.world_size)] if per_group else None
    return world.scatter_object(per_rank)
