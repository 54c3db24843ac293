"""Hostile Hugging Face PEFT adapters (checkpoint/peft_adapter.py, issue 40 item 5): every value of adapter_config.json
and every tensor key and factor is checked before it is trusted. A bad one ends in a ConfigError or CheckpointError
naming the file, the key and the value, at load (`read_adapter`, `from_pretrained(lora=...)`, `generate --lora`,
`serve --lora-modules`): never an AttributeError, OverflowError or RecursionError, and never NaN logits later.

The adapter is written by hand for the tiny "gqa" model (no peft needed): LoRA on q_proj and v_proj of both layers,
one thing corrupted per case.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from distributed import free_port
from tiny import TINY_CONFIGS

CONFIG = TINY_CONFIGS["gqa"]
RANK = 4
GOOD_CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
               "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "use_dora": False}
PREFIX = "base_model.model.model.layers"


def model_args():
    from accessory.network.LLM.llama import ModelArgs

    return ModelArgs(**CONFIG)


def good_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small random factors (A (r, dim), B (out, r)) for q_proj and v_proj of both layers."""
    args, g = model_args(), torch.Generator().manual_seed(seed)
    outputs = {"q_proj": args.n_heads * args.head_dim, "v_proj": args.n_kv_heads * args.head_dim}
    tensors = {}
    for layer in range(args.n_layers):
        for module, out in outputs.items():
            key = f"{PREFIX}.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = 0.1 * torch.randn(RANK, args.dim, generator=g)
            tensors[f"{key}.lora_B.weight"] = 0.1 * torch.randn(out, RANK, generator=g)
    return tensors


def write_adapter(folder: Path, config=None, tensors=None, config_text: str = None) -> Path:
    """An adapter folder: adapter_config.json (`config`, or `config_text` as written) and its safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    text = config_text if config_text is not None else json.dumps(GOOD_CONFIG if config is None else config)
    (folder / "adapter_config.json").write_text(text)
    save_file(good_tensors() if tensors is None else tensors, str(folder / "adapter_model.safetensors"))
    return folder


def with_config(**changes) -> dict:
    return {**GOOD_CONFIG, **changes}


def renamed(old_layer: str, new_layer: str) -> dict[str, torch.Tensor]:
    """The good tensors with layer `old_layer`'s keys written with `new_layer` where the layer number goes."""
    return {key.replace(f"layers.{old_layer}.", f"layers.{new_layer}."): value for key, value in good_tensors().items()}


def changed(key_end: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = good_tensors()
    [key] = [k for k in tensors if k.endswith(key_end)]
    tensors[key] = value
    return tensors


Q0 = "layers.0.self_attn.q_proj"
A_SHAPE = (RANK, CONFIG["dim"])
CONFIG_CASES = {  # name -> (adapter_config.json text, words the error must hold)
    "alpha NaN": (json.dumps(with_config(lora_alpha=math.nan)), "lora_alpha must be a finite number"),
    "alpha Infinity": (json.dumps(with_config(lora_alpha=math.inf)), "got inf"),
    "alpha -Infinity": (json.dumps(with_config(lora_alpha=-math.inf)), "got -inf"),
    "alpha 1e308": (json.dumps(with_config(lora_alpha=1e308)), "<= 1000000.0"),
    "alpha 400 digits": (json.dumps(with_config(lora_alpha=10 ** 399)), "an integer of about 400 digits"),
    "alpha zero": (json.dumps(with_config(lora_alpha=0)), "> 0, got 0"),
    "alpha negative": (json.dumps(with_config(lora_alpha=-8)), "> 0, got -8"),
    "alpha string": (json.dumps(with_config(lora_alpha="8")), "lora_alpha must be a finite number"),
    "alpha missing": (json.dumps({k: v for k, v in GOOD_CONFIG.items() if k != "lora_alpha"}), "got None"),
    "r zero": (json.dumps(with_config(r=0)), "r must be an integer [1, 4096], got 0"),
    "r huge": (json.dumps(with_config(r=10 ** 12)), "r must be an integer [1, 4096], got 1000000000000"),
    "r NaN": (json.dumps(with_config(r=math.nan)), "r must be an integer"),
    "r fractional": (json.dumps(with_config(r=4.5)), "got 4.5"),
    "r true": (json.dumps(with_config(r=True)), "got True"),
    "r list": (json.dumps(with_config(r=[4])), "got [4]"),
    "use_rslora string": (json.dumps(with_config(use_rslora="yes")), "use_rslora must be true or false"),
    "fan_in_fan_out number": (json.dumps(with_config(fan_in_fan_out=1)), "fan_in_fan_out must be true or false"),
    "target_modules number": (json.dumps(with_config(target_modules=5)), "target_modules must be a list"),
    "target_modules nested": (json.dumps(with_config(target_modules=[["q_proj"]])), "target_modules must be"),
    "peft_type list": (json.dumps(with_config(peft_type=["LORA"])), "peft_type ['LORA']"),
    "use_dora NaN": (json.dumps(with_config(use_dora=math.nan)), "use_dora is nan"),
    "nested 200000 deep": ('{"r": 4, "lora_alpha": 8, "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
                           "JSON nested 200001 deep"),
    "not an object": ("[4, 8]", "expected a JSON object, found list"),
    "not JSON": ('{"r": 4, "lora_alpha": ', "cannot be read as JSON"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_hostile_adapter_config_is_refused_naming_file_key_and_value(tmp_path, case):
    from accessory.checkpoint.peft_adapter import read_adapter
    from accessory.errors import ConfigError

    text, words = CONFIG_CASES[case]
    folder = write_adapter(tmp_path / "adapter", config_text=text)
    with pytest.raises(ConfigError) as error:
        read_adapter(folder, model_args())
    assert words in str(error.value) and str(folder / "adapter_config.json") in str(error.value)


TENSOR_CASES = {  # name -> (tensors, words the error must hold)
    "NaN in lora_A": (changed(f"{Q0}.lora_A.weight", torch.full(A_SHAPE, math.nan)),
                      f"q_proj.lora_A.weight' holds {RANK * CONFIG['dim']} NaN or infinite value(s)"),
    "inf in lora_B": (changed("layers.1.self_attn.v_proj.lora_B.weight", torch.full((16, RANK), math.inf)),
                      "v_proj.lora_B.weight' holds 64 NaN or infinite"),
    "one NaN in bfloat16": (changed(f"{Q0}.lora_A.weight", torch.zeros(A_SHAPE, dtype=torch.bfloat16)
                                    .index_fill_(1, torch.tensor([3]), math.nan)), "holds 4 NaN"),
    "integer factor": (changed(f"{Q0}.lora_A.weight", torch.ones(A_SHAPE, dtype=torch.int32)),
                       "is torch.int32; a LoRA factor is a floating-point tensor"),
    "layer 01": (renamed("1", "01"), "layer index '01' is not a plain decimal number"),
    "layer Arabic-Indic one": (renamed("1", "\u0661"), "layer index '\u0661' is not a plain decimal number"),
    "layer 00": (renamed("0", "00"), "layer index '00'"),
    "layer -1": (renamed("1", "-1"), "layer index '-1'"),
    "layer 1e0": (renamed("1", "1e0"), "layer index '1e0'"),
    "layer of 5000 digits": (renamed("1", "9" * 5000), "layer index '9999"),
    "layer beyond the model": (renamed("1", "2"), "layer 2 is beyond the base model's 2 layers"),
    "layer far beyond": (renamed("1", "123456789"), "layer 123456789 is beyond"),
    "scaled B overflows": (changed(f"{Q0}.lora_B.weight", torch.full((96, RANK), 3e38)),
                           "lora_B times the scaling 2 (lora_alpha / r) overflows float32"),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_a_hostile_tensor_is_refused_naming_it(tmp_path, case):
    from accessory.checkpoint.peft_adapter import read_adapter
    from accessory.errors import CheckpointError

    tensors, words = TENSOR_CASES[case]
    folder = write_adapter(tmp_path / "adapter", tensors=tensors)
    with pytest.raises(CheckpointError) as error:
        read_adapter(folder, model_args())
    assert words in str(error.value) and str(folder / "adapter_model.safetensors") in str(error.value)


def test_a_bin_file_that_is_not_a_dict_of_tensors_is_refused(tmp_path):
    from accessory.checkpoint.peft_adapter import read_adapter
    from accessory.errors import CheckpointError

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(GOOD_CONFIG))
    torch.save([torch.zeros(2)], folder / "adapter_model.bin")
    with pytest.raises(CheckpointError, match="expected a dict of named tensors, got list"):
        read_adapter(folder, model_args())


def test_the_good_adapter_is_read_with_its_scaling(tmp_path):
    """The control: the unchanged adapter loads (s = alpha / r = 2, folded into B)."""
    from accessory.checkpoint.peft_adapter import read_adapter

    adapter = read_adapter(write_adapter(tmp_path / "adapter"), model_args())
    assert (adapter.rank, adapter.scaling) == (RANK, 2.0)
    assert sorted(adapter.factors) == ["layers.0.attention.wq", "layers.0.attention.wv", "layers.1.attention.wq",
                                       "layers.1.attention.wv"]


@pytest.fixture
def nan_alpha(tmp_path) -> Path:
    return write_adapter(tmp_path / "nan", config_text=json.dumps(with_config(lora_alpha=math.nan)))


def test_from_pretrained_refuses_at_load_for_every_request_and_per_request(tiny_checkpoints, nan_alpha, tmp_path):
    from accessory.errors import CheckpointError, ConfigError
    from accessory.model.meta import MetaModel

    ckpt = tiny_checkpoints["gqa", 1]
    with pytest.raises(ConfigError, match="lora_alpha must be a finite number"):
        MetaModel.from_pretrained(ckpt, max_seq_len=64, lora=nan_alpha)
    zero_one = write_adapter(tmp_path / "01", tensors=renamed("1", "01"))
    with pytest.raises(CheckpointError, match="layer index '01'"):
        MetaModel.from_pretrained(ckpt, max_seq_len=64, lora_modules={"a": zero_one})


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accessory", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_generate_lora_and_serve_lora_modules_exit_2_naming_the_adapter(tiny_checkpoints, nan_alpha, tmp_path):
    """Refused at load: generate does not run a request that could only give NaN logits, serve does not start."""
    ckpt = str(tiny_checkpoints["gqa", 1])
    done = run_cli("generate", "--pretrained_path", ckpt, "--max_seq_len", "64", "--max_gen_len", "2",
                   "--lora", str(nan_alpha), "--prompt", "Hello")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "lora_alpha must be a finite number" in done.stderr and str(nan_alpha) in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    arabic = write_adapter(tmp_path / "arabic", tensors=renamed("1", "\u0661"))
    done = run_cli("serve", "--pretrained_path", ckpt, "--max_seq_len", "64", "--port", str(free_port()),
                   "--lora-modules", f"sql={arabic}")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "layer index '\u0661' is not a plain decimal number" in done.stderr and "Traceback" not in done.stderr


# ---- fuzz: adapter_config.json values ------------------------------------------------------------------------------

KEYS = ["r", "lora_alpha", "target_modules", "use_rslora", "fan_in_fan_out", "peft_type", "use_dora",
        "modules_to_save", "rank_pattern", "alpha_pattern", "bias", "lora_bias", "layer_replication",
        "target_parameters", "task_type", "base_model_name_or_path"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.integers(10 ** 300, 10 ** 400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from([0, 1, 4, 8, 16, 4096, 4097, 1e6, 1e6 + 1, 1e-300, -0.0, "LORA", "none", "all", "q_proj"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
OVERRIDES = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), VALUES, max_size=6)


@settings(max_examples=2000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(overrides=OVERRIDES, drop=st.sets(st.sampled_from(KEYS), max_size=3))
def test_fuzzed_adapter_configs_are_accepted_or_refused_by_name(overrides, drop):
    """Realistic configs with random values put in and keys left out, through the JSON text as the file holds it:
    each is accepted with a sane (r, scaling), or refused with ConfigError; nothing else escapes."""
    from accessory.checkpoint.peft_adapter import MAX_RANK, checked_config
    from accessory.errors import ConfigError
    from accessory.untrusted import json_object

    config = {**{k: v for k, v in GOOD_CONFIG.items() if k not in drop}, **overrides}
    path = Path("adapter_config.json")
    try:
        rank, scaling = checked_config(json_object(json.dumps(config), str(path), ConfigError), path)
    except ConfigError as e:
        assert str(path) in str(e)
        return
    assert isinstance(rank, int) and 1 <= rank <= MAX_RANK
    assert math.isfinite(scaling) and scaling > 0
