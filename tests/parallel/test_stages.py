"""Pipeline stages' layer splits (parallel/stages.py): even, explicit (`--pp-layers 12,18`) and by memory (`--pp-layers
auto`). Oracles: counts by hand, and for the split by memory every possible split enumerated."""
from __future__ import annotations

import itertools
import random

import pytest

from accessory.errors import ConfigError
from accessory.parallel.stages import by_memory, even_split, explicit_split, fits, stage_bytes


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
    ("12,x", "expected 2 whole numbers separated by commas, or 'auto'"),
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
        split = by_memory(layer_bytes, first, last, budgets)
        assert [i for layers in split for i in layers] == list(range(n_layers)) and min(counts(split)) >= 1
        held = stage_bytes(split, layer_bytes, first, last)
        assert max(h / b for h, b in zip(held, budgets)) == pytest.approx(
            brute_force(layer_bytes, first, last, budgets))


def test_a_split_by_memory_follows_the_budgets_and_what_the_ends_hold():
    layers = [10] * 30
    assert counts(by_memory(layers, 0, 0, [1000, 1000])) == [15, 15]
    assert counts(by_memory(layers, 0, 0, [1000, 2000])) == [10, 20]
    assert counts(by_memory(layers, 100, 0, [1000, 1000])) == [10, 20]  # the embedding takes 10 layers' room
    assert counts(by_memory(layers, 0, 100, [1000, 1000])) == [20, 10]  # the head too


def test_whether_a_split_fits_its_budgets():
    split = by_memory([10] * 4, 5, 5, [30, 30])
    assert stage_bytes(split, [10] * 4, 5, 5) == [25, 25]
    assert fits(split, [10] * 4, 5, 5, [30, 30]) and not fits(split, [10] * 4, 5, 5, [30, 24])
    with pytest.raises(ConfigError, match=r"every stage needs a memory budget above 0 bytes, got \[30, 0\]"):
        by_memory([10] * 4, 5, 5, [30, 0])
