"""Configuration: `--config FILE.yaml` (any flag of the verb, the command line overriding it), `--chat-template FILE`,
and every file of the top-level configs/ folder.

Oracles: the same flags given on the command line (argparse's own parsing); the published parameter counts and FFN
sizes of LLaMA-2 / LLaMA-3 (Meta's and Hugging Face's model cards); transformers' llama3 RoPE frequencies;
LLaMA2-Accessory's PEFT files (Alpha-VLLM/LLaMA2-Accessory, accessory/configs/model/finetune/sg/); the prompt a
custom template writes, worked out by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, tokenizer_copy
from tiny import TINY_CONFIGS, tiny_state_dict

from accessory.presets import FLAG_SUFFIXES, MODEL_SUFFIXES, presets_folder

CONFIGS = presets_folder()
MODEL_PRESETS = sorted((CONFIGS / "model").glob("*.json"))
PEFT_PRESETS = sorted((CONFIGS / "peft").glob("*.json"))
SERVE_PRESETS = sorted((CONFIGS / "serve").glob("*.yaml"))


def arguments(argv) -> argparse.Namespace:
    """`accessory ARGV`'s arguments, as main parses them."""
    from accessory.cli import build_parser, parse_args

    return parse_args(build_parser(), [str(a) for a in argv])


def parse(argv) -> dict:
    return vars(arguments(argv))


def usage_error(argv, capsys) -> str:
    """The message of the usage error (exit status 2) that `argv` gets."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text), f"{pattern!r} not in {text!r}"


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def as_argv(values: dict) -> list[str]:
    """A YAML mapping as command-line flags (true: the flag alone; a list: its items)."""
    argv = []
    for key, value in values.items():
        flag = "--" + key.lstrip("-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not False:
            argv += [flag, str(value)]
    return argv


# ---- --config ------------------------------------------------------------------------------------------------------

def test_config_sets_flags_as_the_command_line_does(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", """
prompt: Hello there
max_batch_size: 8          # LLaMA2-Accessory's spelling
--max-gen-len: 24          # with the dashes, vLLM's spelling
temperature: 0.7
top-p: 0.5
quant: int4
compile: true
llama_config: [a.json, llama2-7b]
pretrained_path: /ckpt/one
""")
    from_file = parse(["generate", "--config", config])
    from_flags = parse(["generate", "--prompt", "Hello there", "--max_batch_size", "8", "--max_gen_len", "24",
                        "--temperature", "0.7", "--top_p", "0.5", "--quant", "int4", "--compile", "--llama_config",
                        "a.json", "llama2-7b", "--pretrained_path", "/ckpt/one"])
    assert from_file == {**from_flags, "config": str(config)}
    assert (from_file["max_batch_size"], from_file["temperature"]) == (8, 0.7)  # typed as the flags are


def test_command_line_overrides_the_config(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", "prompt: from the file\nmax-batch-size: 8\ncompile: true\n")
    args = parse(["generate", "--max_batch_size", "2", "--config", config, "--prompt", "from the command line"])
    assert (args["prompt"], args["max_batch_size"], args["compile"]) == ("from the command line", 2, True)


def test_config_abbreviated_as_argparse_allows():
    assert parse(["serve", "--conf", "serve/throughput"])["max_batch_size"] == 64


def test_config_switches_and_optional_values(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", "prompt: x\ncompile: false\nquant: true\nchat: true\n")
    args = parse(["generate", "--config", config])
    assert (args["compile"], args["quant"], args["chat"]) == (False, "int8", True)  # quant: true is --quant alone


def test_config_for_the_demos(tmp_path):
    sys.path.insert(0, str(REPO / "demos"))
    import chat_ui

    config = write_yaml(tmp_path / "demo.yaml", "port: 7999\nmax_batch_size: 4\nsystem: Be brief.\n")
    args = vars(chat_ui.parse_args("demo", ["--config", str(config), "--port", "7001"]))
    assert (args["port"], args["max_batch_size"], args["system"]) == (7001, 4, "Be brief.")


@pytest.mark.parametrize("text, expected", [
    ("max_batch_sise: 8\n", r"run.yaml: unknown key 'max_batch_sise'; accessory generate takes: .*max_batch_size"),
    ("max_queue: 8\n", r"run.yaml: 'max_queue' is a flag of accessory serve, not of accessory generate"),
    ("mp: 2\n", r"run.yaml: 'mp' is a flag of accessory batch, not of accessory generate"),
    ("max_batch_size: 0\n", r"run.yaml: max_batch_size: must be a positive integer or auto, got 0"),
    ("max_batch_size: eight\n", r"run.yaml: max_batch_size: must be a positive integer or auto, got eight"),
    ("max_batch_size: [8]\n", r"run.yaml: max_batch_size: expected one value .*got \[8\]"),
    ("temperature: warm\n", r"run.yaml: temperature: must be a finite number >= 0, got warm"),
    ("seed: 1.5\n", r"run.yaml: seed: expected int, got 1.5"),
    ("dtype: fp64\n", r"run.yaml: dtype: expected one of \['fp32', 'bf16', 'fp16'\], got 'fp64'"),
    ("compile: yes please\n", r"run.yaml: compile: expected true or false, got 'yes please'"),
    ("llama_config: []\n", r"run.yaml: llama_config: expected at least one value"),
    ("max_batch_size: 8\nmax-batch-size: 4\n", r"run.yaml: 'max-batch-size' sets --max_batch_size a second time"),
    ("config: other.yaml\n", r"run.yaml: 'config': a config file cannot name another one"),
    ("- max_batch_size: 8\n", r"--config .*run.yaml: expected a mapping of flag names to values .*found a list"),
    ("max_batch_size: [8\n", r"--config .*run.yaml: not valid YAML"),
    # a value or key is quoted clipped, whatever its size or depth
    ("max_batch_size: " + "9" * 100_000 + "x\n",
     r"run.yaml: max_batch_size: must be a positive integer or auto, got 9{100}9*\.\.\. \(100[0-9]{3} characters\)$"),
    ("max_batch_size: [" + "[" * 10 + "1" + "]" * 10 + "]\n", r"got \[\[\[\[\.\.\.\]\]\]\]$"),
    ("? " + "x" * 100_000 + "\n: 1\n", r"run.yaml: unknown key 'x+\.\.\.x+'; accessory generate takes"),
])
def test_config_errors_name_the_file_the_key_and_the_expectation(text, expected, tmp_path, capsys):
    config = write_yaml(tmp_path / "run.yaml", text)
    assert_matches(expected, usage_error(["generate", "--prompt", "x", "--config", config], capsys))


BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 9)}]\n" for i in range(10))
CONFINED = """
import argparse, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a bomb that went off would fail here, not eat the machine
from accessory.config_file import apply_config
parser = argparse.ArgumentParser(prog="probe")
parser.add_argument("--max_batch_size", type=int)
apply_config(parser, sys.argv[1])
"""


@pytest.mark.parametrize("text, expected", [
    # the probe's alias bomb: ten levels of nine aliases, 9**10 items once expanded (it took 33 s and 3.4 GB)
    (BOMB.replace("l9:", "max_batch_size:"), r"run.yaml: l1: line 2: YAML aliases \(\*l0\) are not allowed"),
    (BOMB.replace("l9: &l9", "max_batch_size:").replace("l0:", "max-batch-size:"),
     r"run.yaml: l1: line 2: YAML aliases \(\*max-batch-size\)|run.yaml: l1: line 2: YAML aliases \(\*l0\)"),
    ("base: &b 1\nmax_batch_size: *b\n", r"run.yaml: max_batch_size: line 2: YAML aliases \(\*b\) are not allowed"),
    ("max_batch_size: " + "[" * 100_000 + "]" * 100_000 + "\n", r"run.yaml: not valid YAML \(nested too deeply\)"),
])
def test_config_bombs_are_refused_by_file_and_key_in_short_messages(text, expected, tmp_path):
    """A YAML alias repeats a node without copying it: ten nested levels of nine made a value that converting or
    quoting in an error expanded to billions of items. Aliases are refused as the file is parsed, nesting too deep
    for the parser is a usage error, and an error quotes at most a few hundred characters of any value. Run with
    1 GiB of address space, so that a bomb that goes off fails instead of filling the machine."""
    config = write_yaml(tmp_path / "run.yaml", text)
    result = subprocess.run([sys.executable, "-c", CONFINED, str(config)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and error.startswith("probe: error: "), result.stderr[-2000:]
    assert_matches(expected, error)
    assert len(error) < 700


def test_config_larger_than_a_megabyte_is_refused_unread(tmp_path, capsys):
    config = write_yaml(tmp_path / "run.yaml", "# " + "x" * (1 << 20) + "\nmax_batch_size: 8\n")
    assert_matches(r"run.yaml: over 1048576 bytes", usage_error(["serve", "--config", config], capsys))


def test_config_that_is_neither_a_file_nor_a_preset(capsys):
    error = usage_error(["serve", "--config", "serve/fastest"], capsys)
    assert "--config 'serve/fastest' is neither a file nor a preset; presets: default, low-latency, throughput" in error


def test_empty_config_sets_nothing(tmp_path):
    config = write_yaml(tmp_path / "empty.yaml", "# nothing yet\n")
    assert parse(["serve", "--config", config]) == {**parse(["serve"]), "config": str(config)}


# ---- serving presets ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SERVE_PRESETS, ids=lambda p: p.stem)
def test_serve_preset_sets_what_its_flags_would(path):
    values = yaml.safe_load(path.read_text())
    by_name = parse(["serve", "--config", f"serve/{path.stem}"])
    assert by_name == {**parse(["serve", *as_argv(values)]), "config": f"serve/{path.stem}"}
    assert parse(["serve", "--config", path]) == {**by_name, "config": str(path)}


def test_default_serve_preset_is_serves_defaults():
    """configs/serve/default.yaml writes out serve's defaults: it must not drift from them."""
    assert parse(["serve", "--config", "serve/default"]) == {**parse(["serve"]), "config": "serve/default"}


# ---- model presets --------------------------------------------------------------------------------------------------

# Parameter counts and FFN sizes as published (Hugging Face model cards / config.json `intermediate_size`).
PUBLISHED = {
    "llama2-7b": (6_738_415_616, 11008), "llama2-13b": (13_015_864_320, 13824),
    "llama2-70b": (68_976_648_192, 28672), "llama3-8b": (8_030_261_248, 14336),
    "llama3-70b": (70_553_706_496, 28672), "llama3.1-8b": (8_030_261_248, 14336),
    "llama3.1-70b": (70_553_706_496, 28672),
}


@pytest.mark.parametrize("path", MODEL_PRESETS, ids=lambda p: p.stem)
def test_model_preset_builds_the_published_model(path, tmp_path):
    from accessory.checkpoint.config import read_spec
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    assert path.stem in PUBLISHED, f"{path}: add its published parameter count and FFN size to PUBLISHED"
    spec = read_spec([tmp_path], llama_config=[path.stem])  # by name, as --llama_config llama2-7b
    assert spec.config == json.loads(path.read_text())
    args = ModelArgs.from_dict(spec.config, source=str(path))
    with torch.device("meta"):
        model = Transformer(args, ParallelContext(None, 0, 1, 0))
    assert (sum(p.numel() for p in model.parameters()), args.ffn_hidden_dim) == PUBLISHED[path.stem]


@pytest.mark.parametrize("path", [p for p in MODEL_PRESETS if "rope_scaling" in json.loads(p.read_text())],
                         ids=lambda p: p.stem)
def test_llama31_rope_scaling_matches_transformers(path):
    """The frequencies of the preset's llama3 RoPE scaling at its real head size, against transformers' rule (the
    same rule on tiny weights gives HF's logits: test_hf_oracle.py, config "gqa")."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from accessory.network.components import rope_frequencies
    from accessory.network.LLM.llama import ModelArgs

    args = ModelArgs.from_dict(json.loads(path.read_text()))
    hf_config = LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, rope_theta=args.rope_theta,
                            rope_scaling=dict(args.rope_scaling), max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours, _ = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    plain, _ = rope_frequencies(args.head_dim, args.rope_theta, None)
    kept, divided = ours == plain, torch.isclose(ours, plain / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # the rule's three bands all occur


def test_unknown_model_preset_lists_the_presets(tmp_path):
    from accessory.checkpoint.config import read_spec
    from accessory.errors import ConfigError

    with pytest.raises(ConfigError, match=r"llama_config 'llama2-8b' is neither a file nor a preset; presets: "
                                          r"llama2-13b, llama2-70b, llama2-7b, .*llamaPeft_normBiasLora"):
        read_spec([tmp_path], llama_config=["llama2-8b"])


@pytest.mark.parametrize("suffixes", [MODEL_SUFFIXES, FLAG_SUFFIXES])
def test_preset_names_are_unique(suffixes):
    from accessory.presets import preset_names

    names = preset_names(suffixes)
    assert len(names) == len(set(names)), names


def test_every_file_in_configs_is_tested():
    """The parametrized tests above cover configs/model, configs/peft and configs/serve; a file elsewhere would not
    be loaded by any test."""
    assert sorted(p for p in CONFIGS.rglob("*") if p.is_file()) == sorted(MODEL_PRESETS + PEFT_PRESETS +
                                                                          SERVE_PRESETS)


# ---- LLaMA2-Accessory's PEFT configs ------------------------------------------------------------------------------

CONFIG = TINY_CONFIGS["mha"]
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
           "feed_forward.w3")


def peft_checkpoint(folder: Path, rank: int, bias: bool, tokenizer: Path) -> Path:
    """A complete llama_peft checkpoint of the tiny "mha" model with LoRA factors of `rank` and biases, whose
    config.json holds only the base model's keys (the PEFT settings must come from --llama_config)."""
    from accessory.checkpoint.save import save_checkpoint

    g = torch.Generator().manual_seed(3)
    state = tiny_state_dict(CONFIG)
    for key, weight in list(state.items()):
        name = key.removesuffix(".weight")
        if name.split(".", 2)[-1] in LINEARS:
            out, inp = weight.shape
            if rank > 0:
                state[name + ".lora_a.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
                state[name + ".lora_b.weight"] = torch.randn(out, rank, generator=g) / rank ** 0.5
            if bias:
                state[name + ".bias"] = 0.1 * torch.randn(out, generator=g)
    peft = dict(CONFIG, lora_rank=rank, bias_tuning=bias)
    save_checkpoint(folder, state, peft, 1, [tokenizer_copy(tokenizer, folder.parent)], llama_type="llama_peft")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.mark.parametrize("path", PEFT_PRESETS, ids=lambda p: p.stem)
def test_peft_preset_builds_its_llama_peft_model(path, tmp_path, llama_tokenizer):
    """`--llama_type llama_peft --llama_config <base params> NAME` loads a llama_peft checkpoint whose LoRA rank and
    biases are the file's; without the preset the same folder is refused (its LoRA tensors have no place)."""
    from accessory.cli import load_model
    from accessory.errors import CheckpointError

    settings = json.loads(path.read_text())
    rank, bias = settings.get("lora_rank", -1), settings.get("bias_tuning", True)  # llama_peft's defaults
    folder = peft_checkpoint(tmp_path / "peft", rank, bias, llama_tokenizer)
    base_params = tmp_path / "params.json"
    base_params.write_text(json.dumps(CONFIG))
    flags = ["generate", "--prompt", "x", "--pretrained_path", folder, "--llama_type", "llama_peft", "--max_seq_len",
             "64", "--llama_config", base_params]
    model = load_model(arguments(flags + [path.stem]))
    assert {k: getattr(model.llma.args, k) for k in settings} == settings
    tensors = model.llma.saved_tensors()
    for name in [f"layers.1.{linear}" for linear in LINEARS]:
        assert (tensors[name + ".lora_a.weight"].shape[0] if rank > 0 else name + ".lora_a.weight" not in tensors) \
            == (rank if rank > 0 else True)
        assert (name + ".bias" in tensors) == bias
    with pytest.raises(CheckpointError):
        load_model(arguments(flags))


# ---- --chat-template ----------------------------------------------------------------------------------------------

# Ends an assistant turn with "<s>", a control token of the LLaMA tokenizer: it becomes a stop id.
TEMPLATE = ("{% for m in messages %}### {{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}<s>{% endif %}"
            "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}### assistant:{% endif %}")


def test_chat_template_replaces_the_models_own(tiny_checkpoints, tmp_path):
    from accessory.cli import load_model
    from accessory.generation.chat import render_chat

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    flags = ["generate", "--prompt", "x", "--pretrained_path", tiny_checkpoints["mha", 1], "--max_seq_len", "64"]
    plain, custom = load_model(arguments(flags)), load_model(arguments(flags + ["--chat-template", template]))
    assert render_chat(custom.tokenizer, messages) == (
        "### system: Be brief.\n### user: Hi\n### assistant: Hello.<s>\n### user: Name a colour.\n### assistant:", [])
    assert "\n### Human: Hi\n### Assistant: Hello.\n" in render_chat(plain.tokenizer, messages)[0]  # Accessory's
    assert (plain.stop_ids, custom.stop_ids) == ({2}, {1, 2})  # </s>; and the template's end of turn


def test_generate_chat_with_a_chat_template_runs_the_rendered_prompt(tiny_checkpoints, tmp_path, capsys):
    from accessory.cli import main

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ["--pretrained_path", str(tiny_checkpoints["mha", 1]), "--max_seq_len", "64", "--max_gen_len", "8",
             "--chat-template", str(template)]
    main(["generate", "--chat", "--prompt", "Name a colour.", *flags])
    chatted = capsys.readouterr().out
    main(["generate", "--prompt", "### user: Name a colour.\n### assistant:", *flags])
    assert chatted == capsys.readouterr().out and chatted.strip()


@pytest.mark.parametrize("text, expected", [
    (None, r"argument --chat-template/--chat_template: chat template \S*missing.jinja: cannot be read"),
    ("{% for m in messages %}{{ m.content }}", r"argument --chat-template/--chat_template: \S*bad.jinja: chat "
                                                r"template is not a valid Jinja template"),
])
def test_chat_template_errors_name_the_file(text, expected, tmp_path, capsys):
    path = tmp_path / ("missing.jinja" if text is None else "bad.jinja")
    if text is not None:
        path.write_text(text)
    assert_matches(expected, usage_error(["chat", "--chat-template", path], capsys))
    config = write_yaml(tmp_path / "run.yaml", f"chat-template: {path}\n")  # the same check through a config
    assert_matches(expected.replace("argument --chat-template/--chat_template", "run.yaml: chat-template"),
                                usage_error(["serve", "--config", config], capsys))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's long context
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
])
def test_yarn_rope_scaling_matches_transformers(scaling):
    """YaRN's frequencies and its cos/sin factor, as transformers computes them."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from accessory.network.components import rope_frequencies

    hf_config = Qwen2Config(hidden_size=1024, num_attention_heads=8,
                            rope_parameters={**scaling, "rope_theta": 1e6}, max_position_embeddings=131072)
    expected, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    ours, factor = rope_frequencies(128, 1e6, scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(attention) and factor != 1.0
