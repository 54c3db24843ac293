"""Pipeline stages: which contiguous run of a model's layers each stage holds (`--pp N`, `--pp-layers`).

Stage s holds layers `split[s]` (a range); the first stage also holds the embedding, the last the final norm and the
output head. Three ways to split, as `--pp-layers` takes them:
- even (the default): the layers left over go to the first stages, since the last one also computes the head, the
  largest single product of a step when the vocabulary is large;
- balanced: each stage's work a token about the same, the last stage's head counted (placement.py
  `multiplied`): the stages then take about as long a step, and with micro-batches in flight the slowest sets the
  pace;
- explicit: a count per stage, "12,18";
- auto: by each stage's memory budget, counting what the first and last stages hold besides their layers
  (`least_full_split`).
"""
from __future__ import annotations

from typing import Sequence

from accessory.errors import ConfigError


def even_split(n_layers: int, stages: int) -> tuple[range, ...]:
    """`n_layers` over `stages` as evenly as counts allow, the extra layers on the first stages."""
    _check_stages(n_layers, stages)
    per, extra = divmod(n_layers, stages)
    return _ranges([per + (s < extra) for s in range(stages)])


def explicit_split(n_layers: int, stages: int, text: str) -> tuple[range, ...]:
    """`--pp-layers 12,18`: one count of layers per stage, each at least 1, together every layer."""
    _check_stages(n_layers, stages)
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r}: expected {stages} whole numbers separated by commas, "
                          f"or even, balanced or auto")
    if len(counts) != stages:
        raise ConfigError(f"--pp-layers {text!r} gives {len(counts)} stages' layers; --pp is {stages}")
    if min(counts) < 1:
        raise ConfigError(f"--pp-layers {text!r}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise ConfigError(f"--pp-layers {text!r} adds up to {sum(counts)} layers; the model has {n_layers}")
    return _ranges(counts)


def least_full_split(layer_bytes: Sequence[int], first_bytes: int, last_bytes: int,
                     budgets: Sequence[int]) -> tuple[range, ...]:
    """The contiguous runs of layers whose fullest stage is least full, a stage's fullness being what it holds (its
    layers', plus `first_bytes` on the first stage and `last_bytes` on the last) over its budget; every stage at
    least one layer. `--pp-layers auto`: bytes over the bytes free for each stage (whether the split fits them is
    `fits`'s question); `balanced`: a token's work over equal budgets."""
    stages, n_layers = len(budgets), len(layer_bytes)
    _check_stages(n_layers, stages)
    if min(budgets) <= 0:
        raise ConfigError(f"every stage needs a memory budget above 0 bytes, got {list(budgets)}")
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def fullness(s: int, start: int, end: int) -> float:
        held = prefix[end] - prefix[start] + (first_bytes if s == 0 else 0) + (last_bytes if s == stages - 1 else 0)
        return held / budgets[s]

    # best[s][end]: (the least fullest-stage fullness of stages 0..s holding layers 0..end-1, where stage s starts)
    best = [{end: (fullness(0, 0, end), 0) for end in range(1, n_layers - stages + 2)}]
    for s in range(1, stages):
        best.append({end: min((max(best[s - 1][start][0], fullness(s, start, end)), start)
                              for start in range(s, end))
                     for end in range(s + 1, n_layers - stages + s + 2)})
    counts, end = [], n_layers
    for s in reversed(range(stages)):
        start = best[s][end][1]
        counts.append(end - start)
        end = start
    return _ranges(counts[::-1])


def stage_bytes(split: Sequence[range], layer_bytes: Sequence[int], first_bytes: int, last_bytes: int) -> list[int]:
    """Each stage's bytes: its layers', plus the embedding's on the first and the norm's and head's on the last."""
    held = [sum(layer_bytes[i] for i in layers) for layers in split]
    held[0] += first_bytes
    held[-1] += last_bytes
    return held


def fits(split: Sequence[range], layer_bytes: Sequence[int], first_bytes: int, last_bytes: int,
         budgets: Sequence[int]) -> bool:
    return all(need <= budget for need, budget in zip(stage_bytes(split, layer_bytes, first_bytes, last_bytes),
                                                      budgets))


def _check_stages(n_layers: int, stages: int) -> None:
    if not 1 <= stages <= n_layers:
        raise ConfigError(f"--pp {stages}: a model of {n_layers} layers takes 1 to {n_layers} pipeline stages")


def _ranges(counts: list[int]) -> tuple[range, ...]:
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return tuple(out)
