"""Hostile values a user can point the engine at (issue 40, items 6 and 7): --speculative-config (its JSON nesting
bounded before parsing, every field typed and bounded: num_speculative_tokens 1..64 and below max_seq_len),
ACCESSORY_MEMORY_BUDGET (a positive number of bytes, at most 2**60) under `--max-batch-size auto`, and a request
that fails making `accessory generate` exit 1 with its error instead of 0. Each bad value is refused by name:
never a RecursionError, TypeError, IndexError or gigabytes of memory first.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from test_hostile_adapters import good_tensors, write_adapter

SPECULATIVE_REFUSED = {  # name -> (values, words the ConfigError must hold)
    "a million n-gram tokens": ({"method": "ngram", "num_speculative_tokens": 10 ** 6},
                                "num_speculative_tokens must be at most 64, got 1000000"),
    "1e5 self-draft tokens": ({"model": "self", "num_speculative_tokens": 10 ** 5}, "must be at most 64, got 100000"),
    "65 tokens": ({"num_speculative_tokens": 65}, "must be at most 64, got 65"),
    "zero tokens": ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    "tokens true": ({"num_speculative_tokens": True}, "must be an integer >= 1, got True"),
    "tokens float": ({"num_speculative_tokens": 4.0}, "must be an integer >= 1, got 4.0"),
    "tokens string": ({"num_speculative_tokens": "4"}, "must be an integer >= 1, got '4'"),
    "tokens NaN": ({"num_speculative_tokens": math.nan}, "got nan"),
    "tokens of 400 digits": ({"num_speculative_tokens": 10 ** 399}, "an integer of about 400 digits"),
    "lookup max huge": ({"prompt_lookup_max": 10 ** 9}, "prompt_lookup_max must be at most 64, got 1000000000"),
    "lookup min list": ({"prompt_lookup_min": [2]}, "prompt_lookup_min must be an integer >= 1, got [2]"),
    "quant a list": ({"model": "self", "quant": ["int4"]}, "quant must be \"int8\", \"int4\", true (int8), false"),
    "quant an object": ({"model": "self", "quant": {"int4": 1}}, "got {'int4': 1}"),
    "quant 1": ({"model": "self", "quant": 1}, "quant must be"),
    "quant q4_k": ({"model": "self", "quant": "q4_k"}, "got 'q4_k'"),
    "method a list": ({"method": ["ngram"]}, "method must be one of ('ngram', 'draft_model'), got ['ngram']"),
    "method null": ({"method": None}, "got None"),
    "model a number": ({"model": 5}, 'model must be a checkpoint folder or "self", got 5'),
    "model empty": ({"model": ""}, "got ''"),
    "model a list": ({"model": ["self"]}, "got ['self']"),
    "unknown key": ({"lookahead": 3}, "unknown key(s) ['lookahead']"),
}


@pytest.mark.parametrize("case", list(SPECULATIVE_REFUSED))
def test_a_hostile_speculative_config_is_refused_naming_field_and_value(case):
    from accessory.errors import ConfigError
    from accessory.generation.speculative import SpeculativeConfig

    values, words = SPECULATIVE_REFUSED[case]
    with pytest.raises(ConfigError) as error:
        SpeculativeConfig.from_dict(values)
    assert words in str(error.value)


def test_the_bounds_themselves_are_accepted():
    from accessory.generation.speculative import SpeculativeConfig

    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 64, "prompt_lookup_max": 64,
                                          "prompt_lookup_min": 64})
    assert config.num_speculative_tokens == 64
    assert SpeculativeConfig.from_dict({"model": "self", "quant": True}).quant is True
    assert SpeculativeConfig.from_dict({"model": "self", "quant": "int4"}).quant == "int4"


FLAG_REFUSED = {  # --speculative-config's text -> words of the usage error
    "[" * 100_000: "--speculative-config: JSON nested 100000 deep; at most 64 levels were expected",
    '{"a": ' * 100_000: "JSON nested 100000 deep",
    "[]": "--speculative-config: expected a JSON object, found list",
    "ngram": "--speculative-config: cannot be read as JSON",
    '{"model": "self", "quant": ["int4"]}': "speculative_config quant must be",
    '{"num_speculative_tokens": 1000000}': "num_speculative_tokens must be at most 64, got 1000000",
}


@pytest.mark.parametrize("text", list(FLAG_REFUSED), ids=lambda text: text[:24])
def test_the_flag_bounds_its_json_before_parsing_and_names_what_is_wrong(text, capsys):
    from accessory.cli import build_parser
    from accessory.cli.options import speculative_config

    with pytest.raises(argparse.ArgumentTypeError) as error:
        speculative_config(text)
    assert FLAG_REFUSED[text] in str(error.value)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config", text])
    assert exit_info.value.code == 2 and FLAG_REFUSED[text] in capsys.readouterr().err
    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 5}') == {
        "method": "ngram", "num_speculative_tokens": 5}


def test_proposals_that_cannot_fit_max_seq_len_are_refused_before_any_cache(tiny_checkpoints, monkeypatch):
    """num_speculative_tokens 64 at max_seq_len 64: a step would score 65 positions (an IndexError in the costs'
    measurement before); refused naming both numbers, before the measurement allocates anything."""
    from accessory.errors import ConfigError
    from accessory.generation import speculation
    from accessory.generation.speculative import SpeculativeConfig
    from accessory.model.meta import MetaModel

    with pytest.raises(ConfigError, match=r"num_speculative_tokens \(64\) must be below max_seq_len \(64\)"):
        SpeculativeConfig(num_speculative_tokens=64).check_window(64)
    SpeculativeConfig(num_speculative_tokens=63).check_window(64)
    monkeypatch.setattr(speculation, "step_seconds", lambda engines: pytest.fail("measured a step that cannot fit"))
    with pytest.raises(ConfigError, match=r"num_speculative_tokens \(64\) must be below max_seq_len \(64\)"):
        MetaModel.from_pretrained(tiny_checkpoints["gqa", 1], max_seq_len=64,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 64})


# ---- ACCESSORY_MEMORY_BUDGET -------------------------------------------------------------------------------------

BUDGET_REFUSED = ["1e30", "1" + "0" * 30, "9" * 5000, "nan", "inf", "-inf", "-1", "0", "0.5", str(2 ** 60 + 1),
                  "lots", "1e"]


@pytest.mark.parametrize("text", BUDGET_REFUSED, ids=lambda text: text[:12])
def test_an_absurd_memory_budget_is_refused_naming_the_variable_and_value(text, monkeypatch):
    from accessory.errors import ConfigError
    from accessory.network.memory import BUDGET_ENV, memory_budget

    monkeypatch.setenv(BUDGET_ENV, text)
    with pytest.raises(ConfigError) as error:
        memory_budget(torch.device("cpu"))
    message = str(error.value)
    assert message.startswith("ACCESSORY_MEMORY_BUDGET must be a positive number of bytes per rank, got ")
    assert repr(text)[:40] in message and "at most 1152921504606846976" in message and len(message) < 300


def test_a_budget_up_to_2_to_the_60_is_taken_and_auto_rows_stay_bounded(monkeypatch):
    from accessory.generation.batch_size import MAX_ROWS, BatchSizing
    from accessory.network.memory import BUDGET_ENV, memory_budget

    for text, value in [("123", 123), ("4e9", 4_000_000_000), (str(2 ** 60), 2 ** 60)]:
        monkeypatch.setenv(BUDGET_ENV, text)
        assert memory_budget(torch.device("cpu")) == (value, BUDGET_ENV)
    huge = BatchSizing(2 ** 60, BUDGET_ENV, reserved=0, cache_row=8192, step_row=400_000, columns=64)
    assert huge.rows == MAX_ROWS and f"= {MAX_ROWS} rows (the most auto takes)" in huge.describe()
    assert BatchSizing(10 ** 9, BUDGET_ENV, 0, 8192, 400_000, 64).rows == int(10 ** 9 * 0.95) // 408_192


def test_auto_batch_size_with_the_largest_budget_tries_at_most_max_rows(tiny_checkpoints, monkeypatch):
    """The probe's 1e30 bytes overflowed the KV cache's size (a TypeError); the largest budget taken now asks for
    MAX_ROWS rows at most, which backed_off allocates (or halves) as for any budget."""
    from accessory.generation import batch_size
    from accessory.model.meta import MetaModel
    from accessory.network.memory import BUDGET_ENV

    model = MetaModel.from_pretrained(tiny_checkpoints["gqa", 1], max_seq_len=64, max_batch_size=1)
    tried = []
    monkeypatch.setattr(batch_size, "backed_off", lambda model, rows, step_row: tried.append(rows) or rows)
    monkeypatch.setenv(BUDGET_ENV, str(2 ** 60))
    assert batch_size.auto_batch_size(model.llma, reserved=0) == batch_size.MAX_ROWS == tried[0]


# ---- a failed request is not exit 0 --------------------------------------------------------------------------------

def run_generate(ckpt, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accessory", "generate", "--pretrained_path", str(ckpt),
                           "--max_seq_len", "64", "--max_gen_len", "4", "--prompt", "Hello", *args],
                          capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_generate_exits_1_naming_the_failure_when_its_request_fails(tiny_checkpoints, tmp_path):
    """An adapter of finite factors that pass every load-time check but whose product overflows float32 (B A x
    about 1e42): every logit is NaN, the request fails, and generate says so with status 1 and prints no text."""
    tensors = {key: torch.full_like(value, 1e20) for key, value in good_tensors().items()}
    overflowing = write_adapter(tmp_path / "overflowing", tensors=tensors)
    done = run_generate(tiny_checkpoints["gqa", 1], "--lora", str(overflowing))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "generation failed after 0 token(s): SamplingError: the logits hold NaN" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_generate_still_prints_its_text_with_status_0(tiny_checkpoints, tmp_path):
    done = run_generate(tiny_checkpoints["gqa", 1], "--lora", str(write_adapter(tmp_path / "good")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.endswith("\n") and len(done.stdout) > 1
