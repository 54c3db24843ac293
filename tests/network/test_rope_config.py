"""`rope_scaling` is checked in ModelArgs (every checkpoint format builds one), so a factor of NaN, 0 or -1, or llama3
scaling whose frequency band is empty, is a ConfigError naming the file and the value, where it used to load, run
and write other text (issue 40, item 3). Every scaling ModelArgs accepts gives finite, positive rotary frequencies."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accessory.errors import ConfigError
from accessory.network.components import rope_frequencies
from accessory.network.config import ModelArgs

BASE = {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 32, "rope_theta": 10000.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def args_with(scaling, **changes) -> ModelArgs:
    return ModelArgs.from_dict({**BASE, "rope_scaling": scaling, **changes}, source="params.json")


@pytest.mark.parametrize("scaling", [
    None, 2.0, 4, {"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 0.5}, LLAMA3,
    {"rope_type": "llama3"}, {"rope_type": "llama3", "factor": 32.0}, YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
     "attention_factor": 1.1},
], ids=str)
def test_real_scalings_are_accepted(scaling):
    assert args_with(scaling).rope_scaling == scaling


@pytest.mark.parametrize("scaling, message", [
    (math.nan, r"rope_scaling must be a number in \[1e-06, 1000000\.0\], got nan"),
    (0.0, r"rope_scaling must be in \[1e-06, 1000000\.0\], got 0\.0"),
    (-1, r"rope_scaling must be in \[1e-06, 1000000\.0\], got -1"),
    (True, r"rope_scaling must be null, a linear factor or a dict with a rope_type, got True"),
    ("2", r"rope_scaling must be null, a linear factor or a dict with a rope_type, got '2'"),
    ({"rope_type": "linear", "factor": math.nan}, r"rope_scaling linear factor must be a number .*, got nan"),
    ({"rope_type": "linear", "factor": 0}, r"rope_scaling linear factor must be in .*, got 0"),
    ({"rope_type": "linear", "factor": -1.0}, r"rope_scaling linear factor must be in .*, got -1\.0"),
    ({"rope_type": "linear", "factor": math.inf}, r"rope_scaling linear factor must be in .*, got inf"),
    ({"rope_type": "linear"}, r"rope_scaling linear scaling lacks key\(s\) \['factor'\]"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
     r"rope_scaling linear scaling has unknown key\(s\) \['low_freq_factor'\]; it takes \['factor'\]"),
    ({**LLAMA3, "low_freq_factor": 4.0}, r"rope_scaling llama3 low_freq_factor \(4\.0\) must be less than "
                                         r"high_freq_factor \(4\.0\)"),
    ({"rope_type": "llama3", "low_freq_factor": 5.0}, r"rope_scaling llama3 low_freq_factor \(5\.0\) must be less than "
                                                      r"high_freq_factor \(4\.0\)"),  # against Meta's default
    ({**LLAMA3, "low_freq_factor": 0}, r"rope_scaling llama3 low_freq_factor must be in .*, got 0"),
    ({**LLAMA3, "original_max_position_embeddings": 0},
     r"rope_scaling llama3 original_max_position_embeddings must be in \[1, 16777216\], got 0"),
    ({**LLAMA3, "original_max_position_embeddings": 8192.5},
     r"rope_scaling llama3 original_max_position_embeddings must be an integer in \[1, 16777216\], got 8192\.5"),
    ({**LLAMA3, "original_max_position_embeddings": "8192"},
     r"rope_scaling llama3 original_max_position_embeddings must be an integer .*, got '8192'"),
    ({**YARN, "original_max_position_embeddings": -8},
     r"rope_scaling yarn original_max_position_embeddings must be in \[1, 16777216\], got -8"),
    ({**YARN, "attention_factor": math.nan}, r"rope_scaling yarn attention_factor must be a number .*, got nan"),
    ({**YARN, "beta_fast": -1}, r"rope_scaling yarn beta_fast must be in .*, got -1"),
    ({**YARN, "mscale": -1.0}, r"rope_scaling yarn mscale must be in \[0\.0, 1000000\.0\], got -1\.0"),
    ({**YARN, "truncate": "yes"}, r"rope_scaling yarn truncate must be true or false, got 'yes'"),
    ({"rope_type": "yarn", "factor": 4.0},
     r"rope_scaling yarn scaling lacks key\(s\) \['original_max_position_embeddings'\]"),
    ({"rope_type": "dynamic", "factor": 2.0},
     r"rope_scaling rope_type must be one of \['linear', 'llama3', 'yarn'\], got 'dynamic'"),
    ({"factor": 2.0}, r"rope_scaling rope_type must be one of .*, got None"),
    ({"rope_type": ["linear"], "factor": 2.0}, r"rope_scaling rope_type must be one of .*, got \['linear'\]"),
], ids=str)
def test_impossible_scalings_are_refused_by_name(scaling, message):
    with pytest.raises(ConfigError, match=rf"^params\.json: {message}"):
        args_with(scaling)


def test_yarn_needs_a_base_above_one():
    """yarn's ramp divides by log(rope_theta)."""
    with pytest.raises(ConfigError, match=r"params\.json: rope_theta \(1\.0\) must be > 1 with yarn rope scaling"):
        args_with(YARN, rope_theta=1.0)


ROPE_NUMBERS = (st.floats() | st.integers(-4, 1 << 25) | st.sampled_from([0, 1, 2.0, 8192, "2", None, True, [2.0]])
                | st.floats(0.1, 100.0))
ROPE_KEYS = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "type"]
SCALINGS = st.none() | ROPE_NUMBERS | st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["linear", "llama3", "yarn", "dynamic", None, 3])},
    optional={key: ROPE_NUMBERS | st.booleans() for key in ROPE_KEYS})


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(SCALINGS, st.sampled_from([1.0, 1.5, 1e4, 1e6, 1e12]))
def test_any_scaling_is_refused_by_name_or_gives_finite_frequencies(scaling, theta):
    try:
        args = args_with(scaling, rope_theta=theta)
    except ConfigError as e:
        assert str(e).startswith("params.json: rope_"), str(e)
        return
    freqs, scale = rope_frequencies(args.head_dim, *args.rope(None))
    assert bool(torch.isfinite(freqs).all() and (freqs > 0).all()) and math.isfinite(scale) and scale > 0
