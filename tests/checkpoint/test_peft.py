"""llama_peft (LoRA + bias tuning, LLaMA2-Accessory's `accessory/model/LLM/llama_peft.py` and
`accessory/model/peft.py`) and merge-lora.

The fixture is a tiny "mha" model fine-tuned the way LLaMA2-Accessory does it: a plain llama base folder (3 shards)
plus a trainable-only llama_peft folder (2 shards) holding just the tensors its `get_trainable_params` picks (names
with "norm", "bias" or "lora"), with random non-zero LoRA factors and retrained norms. Oracles: a hand-written
float64 forward with W + B A (+ b) on every block linear, and the merged plain checkpoint at one rank.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import tokenizer_copy
from distributed import run_ranks
from tiny import TINY_CONFIGS, greedy_ids, tiny_state_dict

CONFIG = TINY_CONFIGS["mha"]
RANK = 4
PEFT_CONFIG = dict(CONFIG, lora_rank=RANK, bias_tuning=True)
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
           "feed_forward.w3")
TRAINABLE_WORDS = ("norm", "bias", "lora")  # LLaMA2-Accessory's Transformer.get_trainable_params
TOKENS = torch.tensor([[1, 415, 2936, 17354, 1701, 29916, 432, 17204, 975, 278, 17366],
                       [1, 323, 6073, 8943, 27262, 338, 263, 982, 304, 1065, 4802]])
GEN_STEPS = 8


def peft_state_dict(base: dict, biases: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    """The base plus LoRA factors whose update B A is as large as W itself (so outputs change clearly), retrained
    norms, and biases (zero, or random when `biases`)."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: (v * (1 + 0.05 * torch.randn(v.shape, generator=g)) if "norm" in k else v) for k, v in base.items()}
    for key, weight in base.items():
        name = key.removesuffix(".weight")  # layers.N.attention.wq
        if name.split(".", 2)[-1] in LINEARS:
            out, inp = weight.shape
            sd[name + ".lora_a.weight"] = torch.randn(RANK, inp, generator=g) / inp ** 0.5
            sd[name + ".lora_b.weight"] = 0.5 * torch.randn(out, RANK, generator=g) / RANK ** 0.5
            sd[name + ".bias"] = 0.1 * torch.randn(out, generator=g) if biases else torch.zeros(out)
    return sd


def trainable_only(full: Path, dst: Path) -> Path:
    """What LLaMA2-Accessory saves when it saves only the trainable tensors: per shard file, {"model": those}."""
    dst.mkdir()
    for path in sorted(full.glob("consolidated.*.model.pth")):
        tensors = torch.load(path, weights_only=True)
        kept = {k: v for k, v in tensors.items() if any(word in k for word in TRAINABLE_WORDS)}
        torch.save({"model": kept}, dst / path.name)
    for name in ("meta.json", "config.json"):
        shutil.copyfile(full / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, llama_tokenizer) -> dict:
    from accessory.checkpoint.save import save_checkpoint

    root = tmp_path_factory.mktemp("peft")
    tokenizer = [tokenizer_copy(llama_tokenizer, root)]
    base = tiny_state_dict(CONFIG)
    out = {"root": root, "base_sd": base, "base": save_checkpoint(root / "base", base, CONFIG, 3, tokenizer)}
    for name, biases in (("zero_bias", False), ("bias", True)):
        sd = peft_state_dict(base, biases)
        full = save_checkpoint(root / f"full-{name}", sd, PEFT_CONFIG, 2, tokenizer, llama_type="llama_peft")
        out[name + "_sd"], out["full_" + name] = sd, full
        out[name] = trainable_only(full, root / f"trainable-{name}")
    # GQA (2 KV heads, replicated at 4 ranks) with tied embeddings, as one complete llama_peft folder
    gqa = TINY_CONFIGS["gqa"]
    out["gqa"] = save_checkpoint(root / "gqa", peft_state_dict(tiny_state_dict(gqa), biases=False),
                                 dict(gqa, lora_rank=RANK), 1, tokenizer, llama_type="llama_peft")
    return out


# ---- names and layout, pinned against LLaMA2-Accessory's source ---------------------------------------------------

# named_parameters() of one TransformerBlock of LLaMA2-Accessory's llama_peft with lora_rank > 0 and bias_tuning:
# LoraColumnParallelLinear / LoraRowParallelLinear register weight, bias, then the sub-layers lora_a, lora_b.
ACCESSORY_LAYER0 = [f"layers.0.{linear}.{p}" for linear in LINEARS
                    for p in ("weight", "bias", "lora_a.weight", "lora_b.weight")] + [
    "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"]


def test_parameter_names_are_llama2_accessorys():
    from accessory.network.LLM import model_classes
    from accessory.parallel import ParallelContext

    model_args, transformer = model_classes("llama_peft")
    assert (model_args().lora_rank, model_args().bias_tuning) == (-1, True)  # LLaMA2-Accessory's defaults
    with torch.device("meta"):
        model = transformer(model_args(**PEFT_CONFIG), ParallelContext(None, 0, 1, 0))
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n.startswith("layers.0.")] == ACCESSORY_LAYER0
    assert [n for n in names if not n.startswith("layers.")] == ["tok_embeddings.weight", "norm.weight",
                                                                  "output.weight"]


def test_shard_files_have_fairscales_split(ckpt):
    """At 2 shards, each file holds what LLaMA2-Accessory's fairscale layers hold on one of 2 ranks: column layers
    (wq, w1) split W, b and lora_b by rows and replicate lora_a; row layers (wo, w2) split W and lora_a by columns
    and replicate b and lora_b. (dim 96, FFN 100, rank 4.)"""
    expected = {
        "wq.weight": (48, 96), "wq.bias": (48,), "wq.lora_a.weight": (4, 96), "wq.lora_b.weight": (48, 4),
        "wo.weight": (96, 48), "wo.bias": (96,), "wo.lora_a.weight": (4, 48), "wo.lora_b.weight": (96, 4),
        "w1.weight": (50, 96), "w1.bias": (50,), "w1.lora_a.weight": (4, 96), "w1.lora_b.weight": (50, 4),
        "w2.weight": (96, 50), "w2.bias": (96,), "w2.lora_a.weight": (4, 50), "w2.lora_b.weight": (96, 4),
    }
    full = ckpt["bias_sd"]
    for index in range(2):
        shard = torch.load(ckpt["full_bias"] / f"consolidated.{index:02d}-of-02.model.pth", weights_only=True)
        for suffix, shape in expected.items():
            block = "attention" if suffix.startswith("w") and suffix[1] in "qkvo" else "feed_forward"
            key = f"layers.1.{block}.{suffix}"
            assert tuple(shard["llma." + key].shape) == shape, key
            if shape == tuple(full[key].shape):  # replicated: the whole tensor in every shard
                assert torch.equal(shard["llma." + key], full[key]), key


# ---- forward: tensor parallel == merged == hand-written reference -------------------------------------------------

def reference_logits(sd: dict, tokens: torch.Tensor) -> torch.Tensor:
    """LLaMA written out from Meta's definition, float64, every block linear x (W + B A)^T + b."""
    sd = {k: v.double() for k, v in sd.items()}
    dim, heads, eps = CONFIG["dim"], CONFIG["n_heads"], CONFIG["norm_eps"]
    head_dim, (batch, length) = dim // heads, tokens.shape

    def linear(x, name):
        w = sd[name + ".weight"] + sd[name + ".lora_b.weight"] @ sd[name + ".lora_a.weight"]
        return x @ w.T + sd[name + ".bias"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * sd[name]

    # Meta's RoPE on interleaved pairs (x[2i], x[2i+1]); linear scaling 2.0 halves the positions.
    freqs = CONFIG["rope_theta"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = (torch.arange(length, dtype=torch.float64)[:, None] / CONFIG["rope_scaling"]) * freqs  # (L, D/2)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def rope(x):  # (B, L, H, D)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(3)

    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    h = sd["tok_embeddings.weight"][tokens]
    for i in range(CONFIG["n_layers"]):
        x, p = rms(h, f"layers.{i}.attention_norm.weight"), f"layers.{i}.attention."
        q, k, v = (linear(x, p + w).view(batch, length, heads, head_dim) for w in ("wq", "wk", "wv"))
        q, k, v = rope(q).transpose(1, 2), rope(k).transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(head_dim) + causal, dim=-1) @ v
        h = h + linear(att.transpose(1, 2).reshape(batch, length, dim), p + "wo")
        x, p = rms(h, f"layers.{i}.ffn_norm.weight"), f"layers.{i}.feed_forward."
        h = h + linear(F.silu(linear(x, p + "w1")) * linear(x, p + "w3"), p + "w2")
    return rms(h, "norm.weight") @ sd["output.weight"].T


def run_models(folder_lists: dict, dtype: torch.dtype = torch.float32) -> dict:
    """On one rank: logits of TOKENS and greedy tokens for each named list of stacked folders."""
    from accessory.model.meta import MetaModel

    results = {}
    for name, folders in folder_lists.items():
        model = MetaModel.from_pretrained(folders, max_seq_len=64, dtype=dtype)
        results[name] = (model.llma(TOKENS), greedy_ids(model, TOKENS.tolist(), GEN_STEPS), model.llama_type)
    return results


@pytest.fixture(scope="module")
def merged(ckpt) -> Path:
    from accessory.checkpoint.merge_lora import merge_lora

    return merge_lora([ckpt["base"], ckpt["zero_bias"]], ckpt["root"] / "merged", shards=1)


@pytest.fixture(scope="module")
def results(ckpt, merged) -> dict:
    """{world: [per-rank results]}: the stacked PEFT folders at 2 and 3 ranks (3 splits FFN 100 unevenly), the GQA
    one at 4 ranks, and at 1 rank all of these, the merged plain checkpoints and the base."""
    from accessory.checkpoint.merge_lora import merge_lora

    stacked = {name: [ckpt["base"], ckpt[name]] for name in ("zero_bias", "bias")}
    # GQA in float64: in float32 the merged and unmerged sums round differently by up to ~1.3e-5 on these logits
    # (each is ~1e-5 from a float64 run); float64 weights leave only the float32 RMSNorm and RoPE (~3e-6).
    gqa_merged = merge_lora(ckpt["gqa"], ckpt["root"] / "gqa-merged", dtype=torch.float64)
    out = {1: [{**run_models({"merged": [merged], "base": [ckpt["base"]], **stacked}),
                **run_models({"gqa_merged": [gqa_merged]}, torch.float64)}]}
    for world in (2, 3):
        out[world] = run_ranks(world, run_models, stacked)
    out[4] = run_ranks(4, run_models, {"gqa": [ckpt["gqa"]]}, torch.float64)
    for world in (2, 3, 4):
        for rank_result in out[world]:
            if isinstance(rank_result, Exception):
                raise AssertionError(rank_result.rank_traceback)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_peft_at_n_ranks_equals_merged_plain_checkpoint_at_one(results, world):
    merged_logits, merged_tokens, merged_type = results[1][0]["merged"]
    assert merged_type == "llama"
    for rank, rank_results in enumerate(results[world]):
        logits, tokens, llama_type = rank_results["zero_bias"]
        assert llama_type == "llama_peft"
        assert (logits - merged_logits).abs().max().item() < 1e-5, f"rank {rank}"
        assert tokens == merged_tokens, f"rank {rank}"


def test_gqa_peft_at_4_ranks_equals_merged_at_one(results):
    """4 ranks > 2 KV heads: wk / wv, their biases and lora_b are replicated in pairs of ranks, as the weights are;
    the output projection is tied to the embeddings (merge writes no output.weight)."""
    merged_logits, merged_tokens, _ = results[1][0]["gqa_merged"]
    for rank, rank_results in enumerate(results[4]):
        logits, tokens, _ = rank_results["gqa"]
        assert (logits - merged_logits).abs().max().item() < 1e-5, f"rank {rank}"
        assert tokens == merged_tokens, f"rank {rank}"


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("variant", ["zero_bias", "bias"])
def test_peft_at_n_ranks_equals_hand_written_reference(ckpt, results, world, variant):
    reference = reference_logits(ckpt[variant + "_sd"], TOKENS)
    for rank, rank_results in enumerate(results[world]):
        logits = rank_results[variant][0]
        assert (logits.double() - reference).abs().max().item() < 1e-5, f"rank {rank}"


def test_lora_and_biases_change_the_outputs(results):
    """So the equalities above could fail: the LoRA factors and the biases each move the logits by far more than
    the tolerance, and the greedy continuation differs from the base model's."""
    at_one = results[1][0]
    base, zero_bias, bias = (at_one[name][0] for name in ("base", "zero_bias", "bias"))
    assert (zero_bias - base).abs().max().item() > 1.0
    assert (bias - zero_bias).abs().max().item() > 0.1
    assert at_one["zero_bias"][1] != at_one["base"][1]


# ---- loading refusals ---------------------------------------------------------------------------------------------

def test_trainable_only_folder_alone_is_refused_naming_missing_keys(ckpt):
    from accessory.errors import CheckpointError
    from accessory.model.meta import MetaModel

    with pytest.raises(CheckpointError, match=r"lacks 16 tensor\(s\).*layers\.0\.attention\.wk\.weight"):
        MetaModel.from_pretrained(ckpt["zero_bias"], tokenizer_path=ckpt["root"] / "tokenizer.model")


def test_base_alone_as_llama_peft_is_refused_naming_lora_keys(ckpt):
    from accessory.errors import CheckpointError
    from accessory.model.meta import MetaModel

    with pytest.raises(CheckpointError, match=r"lacks 42 tensor\(s\).*layers\.0\.attention\.wk\.bias"):
        MetaModel.from_pretrained(ckpt["base"], llama_type="llama_peft", llama_config=[ckpt["zero_bias"] /
                                                                                        "config.json"])


# ---- merge-lora ---------------------------------------------------------------------------------------------------

def test_merged_folder_is_a_plain_llama_with_config_and_tokenizer(ckpt, merged):
    assert json.loads((merged / "meta.json").read_text()) == {"llama_type": "llama"}
    config = json.loads((merged / "config.json").read_text())
    assert not {"lora_rank", "bias_tuning", "norm_tuning"} & config.keys()
    assert {k: config[k] for k in CONFIG} == CONFIG
    assert (merged / "tokenizer.model").read_bytes() == (ckpt["root"] / "tokenizer.model").read_bytes()
    [shard] = merged.glob("consolidated.*.pth")
    tensors = torch.load(shard, weights_only=True)
    key, sd = "layers.1.feed_forward.w2", ckpt["zero_bias_sd"]
    expected = sd[key + ".weight"] + sd[key + ".lora_b.weight"] @ sd[key + ".lora_a.weight"]
    assert torch.allclose(tensors[f"llma.{key}.weight"], expected, atol=1e-6)
    assert torch.equal(tensors["llma.layers.0.ffn_norm.weight"], sd["layers.0.ffn_norm.weight"])  # the retrained


def test_merge_refuses_nonzero_biases_naming_them(ckpt, tmp_path):
    from accessory.checkpoint.merge_lora import merge_lora
    from accessory.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"14 bias tensor\(s\) are non-zero: layers\.0\.attention\.wk\.bias, "
                                              r"layers\.0\.attention\.wo\.bias"):
        merge_lora([ckpt["base"], ckpt["bias"]], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_merge_refuses_existing_destination_plain_llama_and_impossible_shard_count(ckpt, tmp_path):
    from accessory.checkpoint.merge_lora import merge_lora
    from accessory.errors import CheckpointError, ConfigError

    with pytest.raises(CheckpointError, match="already exists"):
        merge_lora([ckpt["base"], ckpt["zero_bias"]], ckpt["zero_bias"])
    with pytest.raises(CheckpointError, match="llama_type is 'llama'; merge-lora takes a llama_peft"):
        merge_lora(ckpt["base"], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"cannot run this model at 13 model-parallel ranks: n_heads \(12\)"):
        merge_lora([ckpt["base"], ckpt["zero_bias"]], tmp_path / "out", shards=13)  # refused before loading
    assert not (tmp_path / "out").exists()


def test_interrupted_merge_leaves_nothing_behind(ckpt, tmp_path, monkeypatch):
    from accessory.checkpoint import save
    from accessory.checkpoint.merge_lora import merge_lora

    real_save, calls = torch.save, []

    def save_then_fail(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as if Ctrl-C arrived while the second shard was written
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(save.torch, "save", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        merge_lora([ckpt["base"], ckpt["zero_bias"]], tmp_path / "out", shards=2)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_the_cli_verb_merges(ckpt, tmp_path, capsys):
    from accessory.cli import main

    main(["weights", "merge-lora", str(ckpt["base"]), str(ckpt["zero_bias"]), str(tmp_path / "out"), "--shards", "2",
          "--dtype", "bf16"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    shards = sorted(p.name for p in (tmp_path / "out").glob("consolidated.*"))
    assert shards == ["consolidated.00-of-02.model.pth", "consolidated.01-of-02.model.pth"]
    tensors = torch.load(tmp_path / "out" / shards[0], weights_only=True)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
