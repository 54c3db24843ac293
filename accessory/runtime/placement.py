"""Where a model's layers go (`--pp N`, `--pp-layers`): the pipeline stages' layers, sized on a model built on the
meta device (no memory), before anything is loaded; and, for a model that cannot fit, the stage count that would.

Sizes are one rank's at the stages' tensor-parallel size, quantized as the model will be: each layer's bytes, the
first stage's extras (the embedding table, a vision tower) and the last stage's (the final norm and the head); and
the work a token makes in each layer and in the head, as the weight elements it multiplies (`balanced`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from accessory.errors import ConfigError
from accessory.network.memory import memory_budget, weight_bytes
from accessory.network.kv_caches import layer_columns
from accessory.parallel import ParallelContext, head_placement
from accessory.parallel.layers import ParallelEmbedding, ParallelWeight
from accessory.parallel.pipeline import Stage
from accessory.parallel.stages import least_full_split, even_split, explicit_split, fits, stage_bytes

log = logging.getLogger(__name__)

AUTO, BALANCED = "auto", "balanced"


@dataclass(frozen=True)
class Sizes:
    """One tensor rank's bytes of each layer, and of what the first and the last stage hold besides layers;
    `shared`: bytes both count that one stage holding both holds once (a tied head that is the embedding table)."""
    layers: list[int]
    first: int
    last: int
    shared: int = 0
    layer_work: tuple[int, ...] = ()  # the weight elements a token multiplies in each layer
    head_work: int = 0  # ... and in the head

    def per_stage(self, split: tuple[range, ...]) -> list[int]:
        held = stage_bytes(split, self.layers, self.first, self.last)
        return [held[0] - self.shared] if len(split) == 1 else held

    def work_shares(self, split: tuple[range, ...]) -> list[float]:
        """Each stage's share of the weights a token multiplies (the head's on the last stage)."""
        work = [sum(self.layer_work[i] for i in layers) for layers in split]
        work[-1] += self.head_work
        return [w / max(sum(work), 1) for w in work]


def model_sizes(build: Callable[[Stage], nn.Module], n_layers: int, tp: int, dtype: torch.dtype) -> Sizes:
    """The sizes of the model `build` makes (on the meta device, quantized as loaded) for one stage of every layer
    at `tp` tensor ranks."""
    with torch.device("meta"):
        whole = build(Stage.whole(n_layers, ParallelContext(None, 0, tp, 0)))
    layers = [weight_bytes(layer, dtype) for layer in whole.layers]
    head, norm = weight_bytes(whole.output, dtype), weight_bytes(whole.norm, dtype)
    shared = head if whole.output.weight is whole.tok_embeddings.weight else 0
    first = weight_bytes(whole, dtype) - sum(layers) - norm - head + shared  # the embedding, a vision tower
    return Sizes(layers, first, norm + head, shared, tuple(map(multiplied, whole.layers)), multiplied(whole.output))


def multiplied(module: nn.Module) -> int:
    """The weight elements a token multiplies in `module`, quantized or not (every expert of a mixture's: a
    uniform overcount across its layers); an embedding's lookup multiplies none."""
    return sum(math.prod(m.weight.shape) for m in module.modules()
               if isinstance(m, ParallelWeight) and not isinstance(m, ParallelEmbedding))


def layer_split(n_layers: int, stages: int, how: Optional[str], sizes: Callable[[], Sizes],
                budgets: Callable[[], list[int]]) -> tuple[range, ...]:
    """Each stage's layers: even (`how` None or "even"), balanced (each stage's work a token about the same, the
    head's counted: `sizes`), explicit ("12,18") or by memory ("auto": `sizes` and each stage's `budgets`); `sizes`
    and `budgets` are asked for only when needed."""
    if how in (None, "even"):
        return even_split(n_layers, stages)
    if how == BALANCED:  # the least work on the busiest stage: with micro-batches in flight, it sets the pace
        found = sizes()
        return least_full_split(found.layer_work, 0, found.head_work, [1] * stages)
    if how == AUTO:
        split = least_full_split((found := sizes()).layers, found.first, found.last, (room := budgets()))
        if not fits(split, found.layers, found.first, found.last, room):
            log.warning("--pp-layers auto: no split of the layers fits every stage's memory budget (%s); the "
                        "load-time check will say which stage falls short", _gib_list(room))
        return split
    return explicit_split(n_layers, stages, how)


def kv_row_bytes(args, split: tuple[range, ...], tp: int, dtype: torch.dtype) -> list[int]:
    """Each stage's KV cache bytes for one row of max_seq_len positions, on its tensor rank holding the most heads."""
    kv_heads = len(head_placement(args.n_heads, args.n_kv_heads, tp, 0).kv_heads)
    return [2 * kv_heads * args.head_dim * dtype.itemsize * sum(layer_columns(args.layer_window(i), args.max_seq_len)
                                                                 for i in layers) for layers in split]


def plan_text(llama_type: str, config: dict, formats: Optional[dict], quant: Optional[str], tp: int, stages: int,
              how: Optional[str], dtype: torch.dtype, source: str) -> str:
    """`accessory inspect --tp --pp`: the stages a model of `config` would have, built on the meta device (nothing
    loaded); "auto" splits by this machine's memory budget for every stage."""
    from accessory.network.LLM import model_classes

    model_args, transformer = model_classes(llama_type)
    args = model_args.from_dict(config, source=source)
    args.check_parallel_size(tp)
    stages = check_stage_count(stages, stages * tp)

    def build(stage: Stage) -> nn.Module:
        llma = transformer(args, ParallelContext(None, 0, stages * tp, 0), stage)
        wanted = formats or (llma.quantization_plan(quant) if quant else {})
        if wanted:
            llma.quantize_(wanted)
        return llma

    sizes = model_sizes(build, args.n_layers, tp, dtype)
    split = layer_split(args.n_layers, stages, how, lambda: sizes,
                        lambda: [memory_budget(torch.device("cpu"))[0]] * stages)
    return (f"plan at {stages} pipeline stage(s) x {tp} tensor rank(s) ({stages * tp} ranks), "
            f"{str(dtype).removeprefix('torch.')} floats, KV cache rows of max_seq_len {args.max_seq_len}:\n"
            + describe_plan(split, tp, sizes, kv_row_bytes(args, split, tp, dtype)))


def stage_budgets(ctx: ParallelContext, stages: int, device: torch.device) -> list[int]:
    """Collective over the model's group: each stage's memory budget, the least of its ranks'."""
    every = [room for room, _ in ctx.all_gather_object(memory_budget(device))]
    tp = len(every) // stages
    return [min(every[s * tp:(s + 1) * tp]) for s in range(stages)]


def describe_plan(split: tuple[range, ...], tp: int, sizes: Sizes, kv_row_bytes: Optional[list[int]] = None) -> str:
    """The plan as lines: each stage's ranks, layers, bytes per rank (and KV cache bytes per row of positions), and
    share of a token's work (the weights it multiplies: with micro-batches in flight, the busiest stage sets the
    pace)."""
    lines = []
    shares = sizes.work_shares(split)
    for s, (layers, held) in enumerate(zip(split, sizes.per_stage(split))):
        extras = [part for part, here in (("embedding", s == 0), ("norm and head", s == len(split) - 1)) if here]
        kv = f", KV cache {_size(kv_row_bytes[s])} a row" if kv_row_bytes else ""
        ranks = f"rank {s}" if tp == 1 else f"ranks {s * tp}-{(s + 1) * tp - 1}"
        lines.append(f"stage {s}: {ranks}, layers {layers.start}-{layers.stop - 1}"
                     f"{' + ' + ' + '.join(extras) if extras else ''}: {_size(held)} of weights a rank{kv}, "
                     f"{shares[s]:.0%} of a token's work")
    return "\n".join(lines)


def fitting_stages(sizes: Sizes, room: int, n_layers: int, stages: int, tp: int) -> str:
    """What would fit `room` bytes a rank, for the refusal: the fewest pipeline stages whose even split does, at
    this tensor-parallel size (`tp`), with the ranks that takes."""
    for more in range(stages + 1, n_layers + 1):
        if max(sizes.per_stage(even_split(n_layers, more))) <= room:
            return (f"--pp {more} (pipeline stages, {more * tp} ranks at {tp} tensor rank(s) a stage, each stage on "
                    f"a machine with this much memory a rank) would fit")
    return (f"no pipeline of up to {n_layers} stages at {tp} tensor rank(s) a stage fits: add tensor ranks a stage, "
            f"or quantize (--quant int4)")


def check_stage_count(stages: object, world: int) -> int:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"pipeline_parallel_size (--pp) must be an integer >= 1, got {stages!r}")
    if world % stages:
        raise ConfigError(f"--pp {stages} must divide the {world} model-parallel ranks (world = data-parallel x "
                          f"pipeline x tensor); launch a multiple of {stages} processes")
    return stages


def _size(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def _gib_list(values: list[int]) -> str:
    return ", ".join(_size(v) for v in values)
