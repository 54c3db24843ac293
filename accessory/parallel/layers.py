"""Tensor-parallel layers in fairscale's layout (Meta's and LLaMA2-Accessory's checkpoints use it).

| layer                 | weight (global shape)        | split            | collective in forward        |
|-----------------------|------------------------------|------------------|------------------------------|
| ColumnParallelLinear  | (out_features, in_features)  | dim 0 (outputs)  | all-gather if gather_output  |
| RowParallelLinear     | (out_features, in_features)  | dim 1 (inputs)   | all-reduce                   |
| ParallelEmbedding     | (num_embeddings, dim)        | dim 1 (features) | all-gather                   |

Each layer records its slice of the global weight as `weight_shard`; the checkpoint loader and saver key all
slicing on that (never on parameter names). A split that does not divide evenly gives every rank
ceil(size / parts) rows and zero-fills the tail of the last ones: zero rows of w1/w3 feed zero columns of w2, and
padded output logits are cut off after the gather. So a vocabulary or FFN size need not divide the rank count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from accessory.parallel.context import ParallelContext


@dataclass(frozen=True)
class Shard:
    """This rank's slice [start, stop) along `dim` of a global tensor that is `size` long there.

    `local_size` (>= stop - start) is the padded length the rank stores.
    """
    dim: int
    start: int
    stop: int
    size: int
    local_size: int


def make_shard(dim: int, size: int, parts: int, index: int) -> Shard:
    local = -(-size // parts)  # ceil
    start = min(index * local, size)
    return Shard(dim, start, min(start + local, size), size, local)


def partition_index(ctx: ParallelContext, parts: int) -> int:
    """Which of `parts` partitions this rank holds; ranks beyond `parts` hold replicas (parts divides world)."""
    return ctx.rank * parts // ctx.world_size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows. `parts` < world size replicates partitions (used for KV heads)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, gather_output: bool = False,
                 parts: Optional[int] = None):
        super().__init__()
        parts = parts or ctx.world_size
        if gather_output and parts != ctx.world_size:
            raise ValueError("gather_output needs one partition per rank")
        self.ctx, self.out_features, self.gather_output = ctx, out_features, gather_output
        self.weight_shard = make_shard(0, out_features, parts, partition_index(ctx, parts))
        self.weight = nn.Parameter(torch.empty(self.weight_shard.local_size, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gathered(F.linear(x, self.weight))

    def gathered(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's outputs y (..., local) as the layer's output: all of them if gather_output, else as they are."""
        if self.gather_output:
            y = self.ctx.all_gather(y, dim=-1)[..., : self.out_features]
        return y


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; x arrives already split, partial products are summed."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.weight_shard = make_shard(1, in_features, ctx.world_size, ctx.rank)
        self.weight = nn.Parameter(torch.empty(out_features, self.weight_shard.local_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(F.linear(x, self.weight))


class ParallelEmbedding(nn.Module):
    """Embedding table split along the feature dimension; every rank gets the full vectors after a gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext):
        super().__init__()
        if embedding_dim % ctx.world_size:
            raise ValueError(f"embedding dim ({embedding_dim}) must be divisible by the model-parallel size "
                             f"({ctx.world_size})")
        self.ctx = ctx
        self.weight_shard = make_shard(1, embedding_dim, ctx.world_size, ctx.rank)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.weight_shard.local_size), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_gather(F.embedding(tokens, self.weight), dim=-1)


def shard_of(model: nn.Module, param_name: str) -> Optional[Shard]:
    """The slice of the global tensor that `param_name` holds on this rank; None if it is replicated."""
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return getattr(module, f"{attr}_shard", None)


def global_shape(local: torch.Tensor, shard: Optional[Shard]) -> list[int]:
    """The shape of the whole tensor that `local` (a rank's parameter) is a slice of."""
    shape = list(local.shape)
    if shard is not None:
        shape[shard.dim] = shard.size
    return shape
