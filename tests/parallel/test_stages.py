"""Pipeline stages' layer splits (parallel/stages.py): even, explicit (`--pp-layers 12,18`), by memory (`--pp-layers
auto`) and balanced (by the work a token makes, runtime/placement.py). Oracles: counts by hand, and for the split by
memory every possible split enumerated."""
from __future__ import annotations

import itertools
import random

import pytest

from accessory.errors import ConfigError
from accessory.parallel.stages import least_full_split, even_split, explicit_split, fits, stage_bytes


def counts(split) -> list[int]:
    return [len(layers) for layers in split]


def test_an_even_split_gives_the_extra_layers_to_the_first_stages_and_covers_every_layer_once():
    assert counts(even_split(30, 2)) == [15, 15]
    assert counts(even_split(30, 4)) == [8, 8, 7, 7]  # the last stage also computes the head
    assert counts(even_split(5, 5)) == [1] * 5
    assert counts(even_split(7, 1)) == [7]
    for n_layers, stages in itertools.product(range(1, 13), range(1, 13)):
        if stages <= n_layers:
            split = even_split(n_layers, stages)
            assert [i for layers in split for i in layers] == list(range(n_layers))
            assert max(counts(split)) - min(counts(split)) <= 1


@pytest.mark.parametrize("stages", [0, -1, 31])
def test_more_stages_than_layers_or_none_is_refused_naming_pp(stages):
    with pytest.raises(ConfigError, match=rf"--pp {stages}: a model of 30 layers takes 1 to 30 pipeline stages"):
        even_split(30, stages)


def test_an_explicit_split_is_taken_as_written():
    assert explicit_split(30, 2, "12,18") == (range(0, 12), range(12, 30))
    assert counts(explicit_split(30, 3, " 1, 28 ,1")) == [1, 28, 1]


@pytest.mark.parametrize("text, message", [
    ("12,x", "expected 2 whole numbers separated by commas, or even, balanced or auto"),
    ("", "expected 2 whole numbers"),
    ("30", "gives 1 stages' layers; --pp is 2"),
    ("10,10,10", "gives 3 stages' layers; --pp is 2"),
    ("0,30", "every stage needs at least one layer"),
    ("-1,31", "every stage needs at least one layer"),
    ("12,17", "adds up to 29 layers; the model has 30"),
])
def test_a_bad_explicit_split_is_refused_naming_the_value(text, message):
    with pytest.raises(ConfigError, match=rf"--pp-layers {text!r}.*{message}".replace("(", r"\(").replace(")", r"\)")):
        explicit_split(30, 2, text)


def brute_force(layer_bytes, first_bytes, last_bytes, budgets) -> float:
    """The least fullest-stage fullness over every split into contiguous non-empty runs."""
    n, stages = len(layer_bytes), len(budgets)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        split = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        held = stage_bytes(split, layer_bytes, first_bytes, last_bytes)
        best = min(best, max(h / b for h, b in zip(held, budgets)))
    return best


def test_a_split_by_memory_leaves_its_fullest_stage_least_full_of_every_split():
    rng = random.Random(0)
    for _ in range(300):
        n_layers, stages = rng.randint(1, 9), rng.randint(1, 4)
        if stages > n_layers:
            continue
        layer_bytes = [rng.randint(1, 100) for _ in range(n_layers)]
        first, last = rng.randint(0, 300), rng.randint(0, 300)
        budgets = [rng.randint(50, 1000) for _ in range(stages)]
        split = least_full_split(layer_bytes, first, last, budgets)
        assert [i for layers in split for i in layers] == list(range(n_layers)) and min(counts(split)) >= 1
        held = stage_bytes(split, layer_bytes, first, last)
        assert max(h / b for h, b in zip(held, budgets)) == pytest.approx(
            brute_force(layer_bytes, first, last, budgets))


def test_a_split_by_memory_follows_the_budgets_and_what_the_ends_hold():
    layers = [10] * 30
    assert counts(least_full_split(layers, 0, 0, [1000, 1000])) == [15, 15]
    assert counts(least_full_split(layers, 0, 0, [1000, 2000])) == [10, 20]
    assert counts(least_full_split(layers, 100, 0, [1000, 1000])) == [10, 20]  # the embedding takes 10 layers' room
    assert counts(least_full_split(layers, 0, 100, [1000, 1000])) == [20, 10]  # the head too


def test_whether_a_split_fits_its_budgets():
    split = least_full_split([10] * 4, 5, 5, [30, 30])
    assert stage_bytes(split, [10] * 4, 5, 5) == [25, 25]
    assert fits(split, [10] * 4, 5, 5, [30, 30]) and not fits(split, [10] * 4, 5, 5, [30, 24])
    with pytest.raises(ConfigError, match=r"every stage needs a memory budget above 0 bytes, got \[30, 0\]"):
        least_full_split([10] * 4, 5, 5, [30, 0])


def test_a_balanced_split_gives_the_head_s_stage_fewer_layers(smollm2_checkpoint, capsys):
    """`--pp-layers balanced` on the built-in model (int4), as `accessory inspect` prints it with each stage's share of
    a token's work: each layer multiplies 3.54M weights a token and the head 28.3M (vocabulary x dim, 8 layers'
    worth), so 2 stages take 19 and 11 layers (67.3M and 67.2M), where an even split gives the head's stage 81.4M
    against 53.1M (61% and 39%); 3 stages take 12, 13 and 5."""
    from accessory.cli import main

    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536  # wq wk wv (3 KV heads of 64) wo, w1 w2 w3
    assert per_layer == 3_538_944 and 49152 * 576 == 8 * per_layer  # the head, as many weights as 8 layers
    for pp, how, expected in ((2, "balanced", ["layers 0-18 + embedding", "layers 19-29 + norm and head"]),
                              (3, "balanced", ["layers 0-11 + embedding", "layers 12-24:",
                                               "layers 25-29 + norm and head"]),
                              (2, "even", ["layers 0-14 + embedding", "layers 15-29 + norm and head"])):
        try:
            main(["inspect", str(smollm2_checkpoint), "--pp", str(pp), "--pp-layers", how, "--quant", "int4"])
        except SystemExit as e:
            assert e.code == 0
        stages = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage ")]
        assert len(stages) == pp and all(part in line for part, line in zip(expected, stages)), stages
        shares = [int(line.rsplit(", ", 1)[1].split("%")[0]) for line in stages]
        assert shares == {"balanced": [50, 50] if pp == 2 else [32, 34, 34], "even": [39, 61]}[how], stages


def test_the_work_a_token_makes_counts_quantized_weights_as_float_ones_and_no_embedding():
    from torch import nn

    from accessory.parallel import ParallelContext
    from accessory.parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
    from accessory.runtime.placement import multiplied

    ctx = ParallelContext(None, 0, 1, 0)
    block = nn.ModuleList([ColumnParallelLinear(64, 96, ctx), RowParallelLinear(96, 64, ctx),
                           ParallelEmbedding(1000, 64, ctx)])
    assert multiplied(block) == 2 * 64 * 96
    block[0].quantize_("int4")
    assert multiplied(block) == 2 * 64 * 96
