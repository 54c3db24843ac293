"""Configuration: every file of the top-level configs/ folder.

Oracles: the published parameter counts and FFN sizes of LLaMA-2 / LLaMA-3 (Meta's and Hugging Face's model
cards); transformers' llama3 RoPE frequencies; LLaMA2-Accessory's PEFT files (Alpha-VLLM/LLaMA2-Accessory, accessory/configs/model/finetune/sg/).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from conftest import tokenizer_copy
from tiny import TINY_CONFIGS, tiny_state_dict

from accessory.presets import FLAG_SUFFIXES, MODEL_SUFFIXES, presets_folder

CONFIGS = presets_folder()
MODEL_PRESETS = sorted((CONFIGS / "model").glob("*.json"))
PEFT_PRESETS = sorted((CONFIGS / "peft").glob("*.json"))
SERVE_PRESETS = sorted((CONFIGS / "serve").glob("*.yaml"))


def arguments(argv) -> argparse.Namespace:
    """`accessory ARGV`'s arguments, as main parses them."""
    from accessory.cli import build_parser

    return build_parser().parse_args([str(a) for a in argv])


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
    from accessory.model.LLM.llama import ModelArgs, Transformer
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

    from accessory.model.components import rope_frequencies
    from accessory.model.LLM.llama import ModelArgs

    args = ModelArgs.from_dict(json.loads(path.read_text()))
    hf_config = LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, rope_theta=args.rope_theta,
                            rope_scaling=dict(args.rope_scaling), max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    plain = rope_frequencies(args.head_dim, args.rope_theta, None)
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
