"""LoRA- and bias-capable tensor-parallel linears, in LLaMA2-Accessory's layout (its `accessory/model/peft.py`:
`LoraColumnParallelLinear`, `LoraRowParallelLinear`), so its `llama_peft` checkpoints load under their own names.

    y = x W^T + b + (x A^T) B^T        A = `lora_a.weight` (rank, in), B = `lora_b.weight` (out, rank), no scaling

| layer                     | W (weight)     | b (bias)                     | A (lora_a)       | B (lora_b)       |
|---------------------------|----------------|------------------------------|------------------|------------------|
| LoraColumnParallelLinear  | split dim 0    | split dim 0, like W's rows   | replicated       | split dim 0      |
| LoraRowParallelLinear     | split dim 1    | replicated, after all-reduce | split dim 1      | replicated       |

Each split tensor carries its own `Shard` (`weight_shard` on the sub-layer, `bias_shard` here), so loading, saving
and resharding need nothing LoRA-specific. With rank <= 0 and no bias these are the plain layers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from accessory.parallel.context import ParallelContext
from accessory.parallel.layers import ColumnParallelLinear, RowParallelLinear, Shard


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank: the LoRA factor on the side of the layer that is not split."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LoraColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, gather_output: bool = False,
                 parts: Optional[int] = None, *, lora_rank: int = 0, bias: bool = False,
                 shard: Optional[Shard] = None):
        super().__init__(in_features, out_features, ctx, gather_output, parts, bias=bias, shard=shard)
        self.lora_a: Optional[nn.Module] = None
        self.lora_b: Optional[nn.Module] = None
        if lora_rank > 0:
            self.lora_a = ReplicatedLinear(in_features, lora_rank)
            # the same rows as W (its heads, KV heads replicated alike when ranks outnumber them), never gathered
            self.lora_b = ColumnParallelLinear(lora_rank, out_features, ctx, parts=parts, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.biased(self.project(x))  # (..., local outputs)
        if self.lora_a is not None:
            y = y + self.lora_b(self.lora_a(x))  # (..., rank) -> (..., local outputs)
        return self.gathered(y)

    def align_(self, align: int) -> None:
        """Re-cut W's rows, and with them the bias's and B's (quantization groups: FeedForward.align_hidden)."""
        super().align_(align)
        if self.lora_b is not None:
            self.lora_b.align_(align)


class LoraRowParallelLinear(RowParallelLinear):
    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, lora_rank: int = 0,
                 bias: bool = False, shard: Optional[Shard] = None):
        super().__init__(in_features, out_features, ctx, shard=shard)
        self.lora_a: Optional[nn.Module] = None
        self.lora_b: Optional[nn.Module] = None
        if lora_rank > 0:
            # Its weight (rank, local inputs) is used below; its partial products are reduced together with W's.
            self.lora_a = RowParallelLinear(in_features, lora_rank, ctx, shard=shard)  # W's columns, on dim 1 too
            self.lora_b = ReplicatedLinear(lora_rank, out_features)
        self.register_parameter("bias", None)
        if bias:  # replicated (no shard): added once, after the sum over ranks
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def align_(self, align: int) -> None:
        """Re-cut W's inputs, and with them A's (quantization groups: FeedForward.align_hidden)."""
        super().align_(align)
        if self.lora_a is not None:
            self.lora_a.align_(align)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)  # (..., out), this rank's partial sum
        if self.lora_a is None:
            y = self.ctx.all_reduce(y)
        else:
            # One all-reduce for both partial sums: (..., out + rank), then split back.
            both = self.ctx.all_reduce(torch.cat((y, self.lora_a.project(x)), dim=-1))
            y, low = both.split([y.shape[-1], both.shape[-1] - y.shape[-1]], dim=-1)
            y = y + self.lora_b(low)
        if self.bias is not None:
            y = y + self.bias
        return y
