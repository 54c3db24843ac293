"""Pipeline stages over a model-parallel group: which ranks form each stage, and the hidden states a stage hands to
the next (`--pp N`).

A model-parallel group of pp x tp ranks is `pp` stages of `tp` consecutive ranks (torchrun numbers a machine's
processes consecutively, so a stage stays on one machine and only its boundary crosses the network). Stage s holds a
contiguous run of layers (stages.py says which); inside a stage the layers are tensor-parallel over the stage's own
group (`Stage.tensor`). At a boundary only the first tensor rank of each stage sends and receives, one copy of the
hidden states, over a TCP connection of its own to the neighbouring stage's first rank (links.py: a send never waits
for the receiver, which reads a step later with micro-batches in flight), then broadcasts them to its stage's other
ranks (through shared memory on one machine).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from accessory.errors import ConfigError, RanksDisagree
from accessory.parallel.context import ParallelContext
from accessory.parallel.links import HIDDEN, Link, connect
from accessory.parallel.shared_memory import group_timeout_s
from accessory.parallel.watchdog import announce_failure, announced_failure, name_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: its place (`index`), every stage's layers (`split`: global layer indices), its
    stage's tensor-parallel context, and, on the stage's first tensor rank, the links to the neighbouring stages'
    first tensor ranks (None: no such stage, or not this stage's first tensor rank)."""
    index: int
    split: tuple[range, ...]
    tensor: ParallelContext
    previous: Optional[Link] = None
    next: Optional[Link] = None
    last_lead: Optional[int] = None  # the global rank of the last stage's first tensor rank
    group: Optional[dist.ProcessGroup] = None  # the whole model's group

    @classmethod
    def whole(cls, n_layers: int, ctx: ParallelContext) -> "Stage":
        """One stage holding every layer: no pipeline."""
        return cls(0, (range(n_layers),), ctx)

    @property
    def count(self) -> int:
        return len(self.split)

    @property
    def layers(self) -> range:
        return self.split[self.index]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def describe(self) -> str:
        return f"stage {self.index} of {self.count}, layers {self.layers.start}-{self.layers.stop - 1}"

    def send(self, h: torch.Tensor) -> None:
        """Hand this stage's output hidden states to the next stage (its first tensor rank sends; the others hold
        the same values and send nothing), without waiting for it to take them."""
        if self.next is not None:
            with self._failures_named("sending to", self.next.peer):
                self.next.send(h.detach().cpu().contiguous(), HIDDEN)

    def settle(self) -> None:
        """Wait until every send has left (the end of a run)."""
        if self.next is not None:
            with self._failures_named("sending to", self.next.peer):
                self.next.flush()

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's output hidden states, `shape`, on every rank of this stage.

        The wait has no timeout of its own: a previous stage may be slow for good reasons (compiling its step, a
        long prefill). A stage that died closes its links, and this rank names it; one that froze or lost its link
        goes silent, and the watchdog (watchdog.py) ends this rank within rank_timeout, naming it; one that is alive
        but elsewhere times out in the step header (wire.py) and says so."""
        if self.previous is None:  # a later tensor rank: its stage's first rank shares what it received
            return self.tensor.broadcast(torch.empty(shape, dtype=dtype, device=self.tensor.device)).to(device)
        with self._failures_named("receiving from", self.previous.peer):
            h = self.previous.receive(shape, dtype, HIDDEN)
        return self.tensor.broadcast(h.to(self.tensor.device)).to(device)

    def from_last(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The last stage's float32 `x` (`shape`: whole logits, scoring), on every rank of the model; collective."""
        if self.count == 1:
            return x
        out = (x.float() if self.last else torch.empty(shape)).to(self.tensor.device).contiguous()
        dist.broadcast(out, src=self.last_lead, group=self.group)
        return out.to(x.device)

    @contextmanager
    def _failures_named(self, doing: str, peer: int):
        """A transfer that fails because a peer left raises the reason that rank announced, or names this stage and
        the peer (and announces it, so every rank's watchdog ends its rank)."""
        try:
            yield
        except RanksDisagree:
            raise
        except RuntimeError as e:
            failed = announced_failure()
            message = (f"rank {failed[0]} failed: {failed[1]}" if failed is not None
                       else f"pipeline {self.describe()}, {doing} rank {peer}: {e}")
            announce_failure(message)
            raise RanksDisagree(message) from e


def pipeline_stage(ctx: ParallelContext, split: tuple[range, ...]) -> Stage:
    """This rank's stage of `ctx`'s group split into len(split) stages of consecutive ranks, stage s holding layers
    split[s]. Collective over `ctx`'s group (each stage's ranks make their stage's group)."""
    stages = len(split)
    if stages == 1:
        return Stage(0, split, ctx)
    if ctx.world_size % stages:
        raise ConfigError(f"--pp {stages} must divide the {ctx.world_size} model-parallel ranks (pipeline x tensor "
                          f"ranks); launch a multiple of {stages} processes")
    tp = ctx.world_size // stages
    index, tensor_rank = divmod(ctx.rank, tp)
    ranks = dist.get_process_group_ranks(ctx.group)  # global ranks, in group order
    mine = ranks[index * tp:(index + 1) * tp]
    group = dist.new_group(mine, use_local_synchronization=True) if tp > 1 else None
    tensor = ParallelContext.of_stage(group, ctx)
    leads = [ranks[s * tp] for s in range(stages)]
    neighbours = [s * tp for s in (index - 1, index + 1) if 0 <= s < stages] if tensor_rank == 0 else []
    links = connect(ctx.group, neighbours, group_timeout_s(ctx.group))
    stage = Stage(index, split, tensor, links.get((index - 1) * tp), links.get((index + 1) * tp), leads[-1], ctx.group)
    name_rank(f"pipeline {stage.describe()}, tensor rank {tensor_rank}")
    return stage
