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
            self.lora_a = RowParallelLinear(in_features, lora_rank, ctx, shard=shard)  # W's columns too
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


# ---- PEFT adapters on any parallel linear (from_pretrained(lora=...), serving --lora-modules) --------------------

class AdapterRouting:
    """Which adapter each token of the forward pass running now uses, when several adapters are held unmerged and
    chosen per request (`--lora-modules`): adapter ids shaped like the tokens, (B, L), with 0 for none. The
    Transformer sets `tokens` before its layers run (from its KV caches' rows' adapters, which move with the rows);
    every `LoraFactors` reads it."""

    def __init__(self):
        self.tokens: Optional[torch.Tensor] = None  # None: no token uses a per-request adapter (scoring)


class LoraFactors(nn.Module):
    """This rank's slices of the LoRA adapters on one linear layer, held unmerged in float (the layer's own weight
    may be quantized): y += (x A^T) B^T per adapter, its scaling folded into B. The adapters' factors are
    concatenated along the LoRA rank: `a` (R, local inputs), `b` (local outputs, R); `owner` (R,) is the adapter
    each of the R rank columns belongs to: 0 for one applied to every token (`lora=`), i > 0 for one applied only
    to the tokens `routing` assigns to adapter i. So rows of several adapters and of the base model run in one
    batch, in one product, with shapes that do not depend on which rows use which adapter.

    A column-parallel layer holds B's rows for its outputs and all of A; a row-parallel one A's columns for its
    inputs and all of B (its partial products x A^T are summed with the layer's own: `down`, then `up`)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, owner: torch.Tensor, routing: Optional[AdapterRouting]):
        super().__init__()
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)
        self.register_buffer("owner", owner, persistent=False)
        self.routing = routing
        self.every_token = bool((owner == 0).all())  # no per-request adapter: no mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., local inputs) -> (..., R): on a row-parallel layer, this rank's partial sum."""
        return F.linear(x.to(self.a.dtype), self.a)

    def up(self, low: torch.Tensor) -> torch.Tensor:
        """(..., R), summed over ranks -> (..., local outputs), each token through its own adapters only."""
        if not self.every_token:
            tokens = self.routing.tokens
            chosen = self.owner == 0
            if tokens is not None:
                chosen = chosen | (self.owner == tokens[..., None])  # (..., R)
            low = low * chosen.to(low.dtype)
        return F.linear(low, self.b)
