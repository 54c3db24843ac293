"""Tensor-parallel layers in fairscale's layout (Meta's and LLaMA2-Accessory's checkpoints use it).

| layer                 | weight (global shape)        | split            | collective in forward        |
|-----------------------|------------------------------|------------------|------------------------------|
| ColumnParallelLinear  | (out_features, in_features)  | dim 0 (outputs)  | all-gather if gather_output  |
| RowParallelLinear     | (out_features, in_features)  | dim 1 (inputs)   | all-reduce                   |
| ParallelEmbedding     | (num_embeddings, dim)        | dim 1 (features) | all-gather                   |
| ExpertLinear          | one expert's w1/w3 or w2     | hidden units     | (the MoE block's all-reduce) |

Each layer records its slice of the global weight as `weight_shard`; the checkpoint loader and saver key all
slicing on that (never on parameter names). A split that does not divide evenly gives every rank
ceil(size / parts) rows and zero-fills the tail of the last ones: zero rows of w1/w3 feed zero columns of w2, and
padded output logits are cut off after the gather. So a vocabulary or FFN size need not divide the rank count.
Attention heads are cut otherwise: whole GQA groups, each rank's slice its own size with nothing padded
(`head_placement`; the layers take that `Shard`).

A layer's weight is a float Parameter, or after `quantize_(fmt)` a `QuantizedWeight` (quantized_weight.py) in blocks of
inputs (groups of 32 for int8 / int4, 32 or 256 for GGUF's block formats); a quantized split of the inputs is
aligned to whole blocks (`align`), or refused where it cannot be (a split of attention heads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from accessory.parallel.context import ParallelContext
from accessory.quant.formats import PARTS, block_size
from accessory.kernels import linear, quantized_linear
from accessory.kernels.build import int8x_kernels
from accessory.parallel.quantized_weight import QuantizedWeight, hold_int8x_copy, int8x_parts


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


def make_shard(dim: int, size: int, parts: int, index: int, align: int = 1) -> Shard:
    """Partition `index` of `parts`: ceil(size / parts) long, rounded up to a multiple of `align`."""
    local = -(-size // parts)  # ceil
    local = -(-local // align) * align
    start = min(index * local, size)
    return Shard(dim, start, min(start + local, size), size, local)


def spread(count: int, parts: int, index: int) -> range:
    """Partition `index` of `parts` of `count` whole units (heads, groups): contiguous, the first count % parts
    partitions one unit larger."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class HeadPlacement:
    """The attention heads one rank holds, as global indices: query heads `heads`, KV heads `kv_heads`."""
    heads: range
    kv_heads: range


def head_placement(n_heads: int, n_kv_heads: int, world: int, rank: int) -> HeadPlacement:
    """Whole GQA groups (a KV head and the n_heads / n_kv_heads query heads that read it) over `world` ranks.

    Up to one KV head per rank: each rank holds a contiguous run of whole groups, the first n_kv_heads % world
    ranks one group more (3 groups at 2 ranks: 2 and 1). More ranks (a multiple of n_kv_heads, at most n_heads):
    each group's world / n_kv_heads ranks hold a copy of its KV head and split its query heads, the first ones a
    head more where they do not divide. Even splits give exactly fairscale's slices."""
    group = n_heads // n_kv_heads
    if world <= n_kv_heads:
        kv_heads = spread(n_kv_heads, world, rank)
        return HeadPlacement(range(kv_heads.start * group, kv_heads.stop * group), kv_heads)
    ranks_per_group = world // n_kv_heads
    kv_head, part = divmod(rank, ranks_per_group)
    own = spread(group, ranks_per_group, part)
    first = kv_head * group
    return HeadPlacement(range(first + own.start, first + own.stop), range(kv_head, kv_head + 1))


def head_shard(dim: int, heads: range, n_heads: int, head_dim: int) -> Shard:
    """The Shard of consecutive `heads` (head_dim wide each) along `dim` of a tensor holding all n_heads."""
    start, stop = heads.start * head_dim, heads.stop * head_dim
    return Shard(dim, start, stop, n_heads * head_dim, stop - start)


def partition_index(ctx: ParallelContext, parts: int) -> int:
    """Which of `parts` partitions this rank holds; ranks beyond `parts` hold replicas (parts divides world)."""
    return ctx.rank * parts // ctx.world_size


class ParallelWeight(nn.Module):
    """A layer with a rank's slice of one weight (`weight`, `weight_shard`), float or quantized; and, once a PEFT
    adapter is attached, its LoRA factors (`adapters`: parallel/lora.py's LoraFactors, else None)."""

    def __init__(self):
        super().__init__()
        self.adapters: Optional[nn.Module] = None

    def adapted(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x W^T plus the attached adapters' x A^T B^T (a column-parallel layer's: all of it on this rank)."""
        return y if self.adapters is None else y + self.adapters(x).to(y.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with this rank's slice of W."""
        weight = self.weight
        return weight.linear(x) if isinstance(weight, QuantizedWeight) else linear(x, weight)

    def plain_parts(self) -> Optional[tuple[str, list[torch.Tensor]]]:
        """This rank's W for a product the kernels make from C++ (kernels/dispatch.py `products_in_one_call`): its
        format and parts in PARTS order, ("", [W]) for float; None with adapters attached or a draft's int8-x copy."""
        weight = self.weight
        if self.adapters is not None or int8x_parts(weight) is not None:
            return None
        if isinstance(weight, QuantizedWeight):
            return weight.fmt, [getattr(weight, name) for name in PARTS[weight.fmt]]
        return "", [weight]

    def quantize_(self, fmt: str) -> None:
        """Hold the weight in `fmt` (quant/formats.py) from now on; on the meta device, before loading."""
        if isinstance(self.weight, QuantizedWeight):
            raise ValueError(f"the weight is already {self.weight.fmt}")
        shard, block = self.weight_shard, block_size(fmt)
        if shard is not None and shard.dim == 1 and (shard.start % block or shard.local_size % block):
            ctx = getattr(self, "ctx", None)
            ranks = f" at {ctx.world_size} model-parallel ranks" if ctx is not None else ""
            parts = "whole attention heads on " if getattr(self, "fixed_split", False) else ""
            raise ValueError(f"{fmt} stores whole blocks of {block} inputs, but this rank's inputs [{shard.start}, "
                             f"{shard.stop}) of {shard.size}{ranks} do not fall on them; load it at a rank count "
                             f"that splits {shard.size} inputs into {parts}multiples of {block}")
        quantized = QuantizedWeight(fmt, *self.weight.shape, shard, device=self.weight.device)
        del self.weight  # a registered parameter cannot be replaced by a module in place
        self.weight = quantized

    def refuse_recut(self) -> None:
        if getattr(self, "fixed_split", False):
            raise ValueError(f"this layer holds a fixed slice {self.weight_shard} (whole attention heads); it is "
                             f"not re-cut")

    def split_(self, dim: int, size: int, parts: int, index: int, align: int) -> None:
        """Re-cut this rank's slice (on the meta device, before loading), e.g. aligned to quantization groups."""
        self.weight_shard = make_shard(dim, size, parts, index, align)
        shape = list(self.weight.shape)
        shape[dim] = self.weight_shard.local_size
        self.weight = nn.Parameter(torch.empty(shape, device=self.weight.device), requires_grad=False)


class ColumnParallelLinear(ParallelWeight):
    """y = x W^T (+ b) with W split by output rows, and the bias b with them. `parts` < world size replicates
    partitions (parts=1: the whole W on every rank); `shard` gives this rank's rows instead (attention heads:
    `head_placement`)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, gather_output: bool = False,
                 parts: Optional[int] = None, align: int = 1, bias: bool = False, shard: Optional[Shard] = None):
        super().__init__()
        self.parts = parts or ctx.world_size
        if gather_output and (self.parts != ctx.world_size or shard is not None):
            raise ValueError("gather_output needs one even partition per rank")
        self.ctx, self.out_features, self.gather_output = ctx, out_features, gather_output
        self.fixed_split = shard is not None
        self.weight_shard = shard or make_shard(0, out_features, self.parts, partition_index(ctx, self.parts), align)
        self.weight = nn.Parameter(torch.empty(self.weight_shard.local_size, in_features), requires_grad=False)
        self.register_parameter("bias", None)
        if bias:
            self._make_bias()

    def _make_bias(self) -> None:
        self.bias = nn.Parameter(torch.empty(self.weight_shard.local_size, device=self.weight_device),
                                 requires_grad=False)
        self.bias_shard = self.weight_shard  # dim 0: the bias of an output row lives with that row

    @property
    def weight_device(self) -> torch.device:
        weight = self.weight
        return weight.device if isinstance(weight, torch.Tensor) else next(weight.buffers()).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gathered(self.adapted(x, self.biased(self.project(x))))

    def biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def align_(self, align: int) -> None:
        """Re-cut W's rows, and with them the bias's."""
        self.refuse_recut()
        self.split_(0, self.out_features, self.parts, partition_index(self.ctx, self.parts), align)
        if self.bias is not None:
            self._make_bias()

    def gathered(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's outputs y (..., local) as the layer's output: all of them if gather_output, else as they are."""
        if self.gather_output:
            y = self.ctx.all_gather(y, dim=-1)[..., : self.out_features]
        return y


class FusedColumns(nn.Module):
    """Column-parallel layers that read the same input, computed as one product: their weights (and biases) become
    row slices of one stacked weight (nothing is copied: fuse before loading), so x @ [Wq; Wk; Wv]^T is one matrix
    product instead of three. The layers keep their own (view) tensors under their own names, so loading and saving
    see them as before; the stacked tensors are not saved. Fuse last: moving the model afterwards would unshare
    them."""

    def __init__(self, layers: list[ColumnParallelLinear]):
        super().__init__()
        self.sizes = [layer.weight.shape[0] for layer in layers]
        self.layers = tuple(layers)  # not registered (they are the model's own): for their adapters, if attached
        self.register_buffer("bias", None, persistent=False)
        if layers[0].bias is not None:
            self.bias = torch.cat([layer.bias.data for layer in layers])
            for layer, view in zip(layers, self.bias.split(self.sizes)):
                layer.bias = nn.Parameter(view, requires_grad=False)
        first = layers[0].weight
        if isinstance(first, QuantizedWeight):
            self.fmt = first.fmt
            for name, part in first.parts.items():
                stacked = torch.cat([layer.weight.parts[name] for layer in layers])  # (sum of rows, ...)
                self.register_buffer(name, stacked, persistent=False)
                for layer, view in zip(layers, stacked.split(self.sizes)):
                    setattr(layer.weight, name, view)
        else:
            self.fmt = None
            self.register_buffer("weight", torch.cat([layer.weight.data for layer in layers]), persistent=False)
            for layer, view in zip(layers, self.weight.split(self.sizes)):
                layer.weight = nn.Parameter(view, requires_grad=False)

    @staticmethod
    def fusable(layers) -> bool:
        """Plain column-parallel layers (no LoRA or gather) holding their weights alike, all with a bias or none."""
        kinds = {(type(layer), getattr(layer.weight, "fmt", None), layer.weight.shape[1], layer.bias is None)
                 for layer in layers}
        return len(kinds) == 1 and type(layers[0]) is ColumnParallelLinear and not layers[0].gather_output

    def plain_parts(self) -> Optional[tuple[str, list[torch.Tensor]]]:
        """The stacked W as ParallelWeight.plain_parts gives a layer's; None if any layer has adapters attached."""
        if any(layer.adapters is not None for layer in self.layers) or int8x_parts(self) is not None:
            return None
        return (self.fmt, [getattr(self, name) for name in PARTS[self.fmt]]) if self.fmt else ("", [self.weight])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fmt is None:
            y = linear(x, self.weight)
        else:
            y = quantized_linear(x, self.fmt, self.q, getattr(self, "scale", None), getattr(self, "min", None),
                                 int8x_parts(self))
        if self.bias is not None:
            y = y + self.bias
        return [layer.adapted(x, part) for layer, part in zip(self.layers, y.split(self.sizes, dim=-1))]


def repack_int4_for_int8x(model: nn.Module) -> int:
    """Give each int4 product of `model` on the CPU its int8-x copy (hold_int8x_copy), where the kernels have that
    product (AVX-512 with VNNI, or AVX2): for a draft model, whose products need not be exact. The layers of a
    FusedColumns are not products of their own (its stacked weight is). Returns the bytes added."""
    if not int8x_kernels():
        return 0
    fused = {id(layer.weight) for module in model.modules() if isinstance(module, FusedColumns)
             for layer in module.layers}
    return sum(hold_int8x_copy(module) for module in model.modules()
               if isinstance(module, (FusedColumns, QuantizedWeight)) and module.fmt == "int4"
               and module.q.device.type == "cpu" and id(module) not in fused)


class RowParallelLinear(ParallelWeight):
    """y = x W^T with W split by input columns; x arrives already split, partial products are summed. `shard`
    gives this rank's columns instead of an even split (attention heads: `head_placement`)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, align: int = 1,
                 shard: Optional[Shard] = None):
        super().__init__()
        self.ctx, self.in_features = ctx, in_features
        self.fixed_split = shard is not None
        self.weight_shard = shard or make_shard(1, in_features, ctx.world_size, ctx.rank, align)
        self.weight = nn.Parameter(torch.empty(out_features, self.weight_shard.local_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)  # (..., out), this rank's partial sum
        if self.adapters is None:
            return self.ctx.all_reduce(y)
        # The adapters' partial sums x A^T (A split by inputs like W) are reduced with W's in one all-reduce.
        both = self.ctx.all_reduce(torch.cat((y, self.adapters.down(x).to(y.dtype)), dim=-1))
        y, low = both.split([y.shape[-1], both.shape[-1] - y.shape[-1]], dim=-1)
        return y + self.adapters.up(low).to(y.dtype)

    def align_(self, align: int) -> None:
        self.refuse_recut()
        self.split_(1, self.in_features, self.ctx.world_size, self.ctx.rank, align)


class ParallelEmbedding(ParallelWeight):
    """Embedding table split along the feature dimension; every rank gets the full vectors after a gather."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext):
        super().__init__()
        if embedding_dim % ctx.world_size:
            raise ValueError(f"embedding dim ({embedding_dim}) must be divisible by the model-parallel size "
                             f"({ctx.world_size})")
        self.ctx = ctx
        self.weight_shard = make_shard(1, embedding_dim, ctx.world_size, ctx.rank)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.weight_shard.local_size), requires_grad=False)

    def forward(self, tokens: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """(..., embedding_dim) vectors of `tokens`; a quantized table gives them in `dtype`."""
        weight = self.weight
        if isinstance(weight, QuantizedWeight):
            local = weight.embed(tokens, dtype or torch.float32)
        else:
            local = F.embedding(tokens, weight)
        return self.ctx.all_gather(local, dim=-1)


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


@dataclass(frozen=True)
class ExpertPlacement:
    """Where a mixture of experts lives on the ranks: rank r holds experts `experts` (global ids, consecutive), each
    cut into `parts` slices of its hidden units, of which it holds slice `part`.

    With g = gcd(experts, ranks), the ranks form g groups of ranks / g; group j holds experts j*E/g .. (j+1)*E/g - 1,
    their hidden units split over the group's ranks. Ranks dividing experts: whole experts per rank (expert
    parallelism, LLaMA2-Accessory's layout: shard r of M holds experts r*E/M ..). Experts dividing ranks: each
    expert split over ranks / E ranks. Neither (8 experts, 6 ranks): 2 groups of 3 ranks, 4 experts each, split in
    3. Every (expert, slice) lives on exactly one rank, so summing the ranks' partial outputs gives the output."""
    experts: range
    parts: int
    part: int


def expert_placement(n_experts: int, world: int, rank: int) -> ExpertPlacement:
    groups = math.gcd(n_experts, world)
    per_group, parts = n_experts // groups, world // groups
    group = rank // parts
    return ExpertPlacement(range(group * per_group, (group + 1) * per_group), parts, rank % parts)


class ExpertLinear(ParallelWeight):
    """One expert's weight W (out, in), this rank's slice of its hidden units: rows (`dim` 0: w1, w3) or columns
    (dim 1: w2) split into `parts`, slice `part`. It has no forward: the MoE block multiplies with the experts'
    weights stacked (they are views of the stack), and sums the ranks' partial outputs once."""

    def __init__(self, in_features: int, out_features: int, dim: int, parts: int, part: int):
        super().__init__()
        self.split = (dim, (out_features, in_features)[dim], parts, part)
        self.weight_shard = make_shard(dim, self.split[1], parts, part)
        shape = [out_features, in_features]
        shape[dim] = self.weight_shard.local_size
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def align_(self, align: int) -> None:
        self.split_(*self.split, align)
