"""Mixtures of experts (issue 21): tiny random Mixtral (4 experts, top 2) and Qwen3-MoE (8 experts, top 2, router
weights not renormalised) built by transformers give its greedy tokens at 1, 2 and 4 ranks (experts whole per rank,
split inside the experts, and both combined), eager and compiled; a Mixtral written in LLaMA2-Accessory's own
2-shard expert-parallel layout (by hand here, not by our saver) loads at 1, 2 and 4 ranks; resharding 2 -> 4 -> 1 on
disk keeps every tensor; routing keeps each token to its own experts; int8 experts keep the logits; transformers 5's
fused in-memory experts import as its saved per-expert ones."""
from __future__ import annotations

import json

import pytest
import torch

from distributed import run_ranks
from test_hf_oracle import converted_hf_models, hf_greedy
from tiny import greedy_ids, save_lively

GEN_STEPS = 16
SIZES = dict(vocab_size=32000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, num_experts_per_tok=2)
# name -> (transformers config and model class, the config's own values). "mixtral3" and "mixtral6" have expert
# counts no rank count here divides (3: split inside the experts at 2 ranks; 6 at 4 ranks: 2 groups of 2 ranks, 3
# experts each, split in 2) and a hidden size of 100 that splits unevenly.
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=128)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=64, intermediate_size=128, head_dim=32,
                       norm_topk_prob=False)),
    "mixtral3": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=3, intermediate_size=100)),
    "mixtral6": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, intermediate_size=100)),
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(10, 32000, (n,), generator=generator).tolist() for n in (7, 40)]


def build_hf(name: str, folder, tokenizer):
    import transformers

    config_class, model_class, own = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**SIZES, **own)).eval()
    save_lively(model, name, folder, tokenizer)
    # experts 3x livelier and a router 3x sharper: at save_lively's scale the experts hardly move the logits of so
    # small a model, and a wrong expert kept the greedy tokens
    with torch.no_grad():
        for key, param in model.named_parameters():
            if ".mlp." in key:
                param.mul_(3.0)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, llama_tokenizer) -> dict:
    """name -> (its HF model, the folder `accessory convert hf` made of it at 2 shards, transformers' tokens)."""
    return converted_hf_models(MODELS, build_hf, tmp_path_factory.mktemp("moe"), llama_tokenizer, prompts(),
                               GEN_STEPS)


def our_tokens(folder, **options) -> list[list[int]]:
    from accessory.model.meta import MetaModel

    return greedy_ids(MetaModel.from_pretrained(str(folder), max_seq_len=128, **options), prompts(), GEN_STEPS)


# ---- LLaMA2-Accessory's own layout, written by hand --------------------------------------------------------------

# fairscale's split of each dense tensor over shards: column layers by output rows, row layers by input columns,
# the embedding by features; norms and the router whole.
def accessory_split(name: str):
    if name.endswith(("wq.weight", "wk.weight", "wv.weight")) or name == "output.weight":
        return 0
    if name.endswith("wo.weight") or name == "tok_embeddings.weight":
        return 1
    return None


def write_accessory_mixtral(canonical: dict, config: dict, folder, tokenizer, shards: int = 2) -> None:
    """A Mixtral checkpoint as LLaMA2-Accessory's `mixtral` type saves it: consolidated.0r-of-0M.model.pth with
    `llma.` names, shard r holding experts r*E/M .. (r+1)*E/M - 1 whole under their global ids, the router and norms
    in every shard; its config.json keys; meta.json naming the type."""
    import re

    folder.mkdir()
    experts = config["moe"]["num_experts"]
    for rank in range(shards):
        shard = {}
        for name, tensor in canonical.items():
            match = re.search(r"\.experts\.(\d+)\.", name)
            if match:
                if int(match.group(1)) * shards // experts == rank:
                    shard["llma." + name] = tensor.clone()
            elif (dim := accessory_split(name)) is None:
                shard["llma." + name] = tensor.clone()
            else:
                shard["llma." + name] = tensor.chunk(shards, dim)[rank].clone()
        torch.save(shard, folder / f"consolidated.{rank:02d}-of-{shards:02d}.model.pth")
    keys = ("dim", "hidden_dim", "head_dim", "n_layers", "n_heads", "n_kv_heads", "norm_eps", "rope_theta", "moe")
    accessory_config = {key: config[key] for key in keys}
    accessory_config["moe"] = {k: config["moe"][k] for k in ("num_experts", "num_experts_per_tok")}
    (folder / "config.json").write_text(json.dumps(accessory_config))
    (folder / "meta.json").write_text(json.dumps({"llama_type": "mixtral"}))
    (folder / "tokenizer.model").write_bytes(tokenizer.read_bytes())


@pytest.fixture(scope="module")
def accessory_mixtral(models, tmp_path_factory, llama_tokenizer):
    from accessory.checkpoint.importers import read_hf

    imported = read_hf(models["mixtral"][1].parent / "mixtral-hf")
    folder = tmp_path_factory.mktemp("accessory") / "mixtral"
    write_accessory_mixtral(imported.state_dict, {**imported.config, "head_dim": 16}, folder, llama_tokenizer)
    return imported, folder


# ---- llama.cpp's GGUF files -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_models(models, tmp_path_factory) -> dict:
    """name -> (a GGUF file written as llama.cpp's converter writes it, the oracle's greedy tokens and logits on the
    longer prompt). Mixtral: architecture llama with experts, float32, so the oracle is the HF model itself.
    Qwen3-MoE: experts in Q8_0 (kept as int8 by us), and the oracle is transformers reading the same file
    (dequantized; llama.cpp renormalises its router weights, and so does transformers' GGUF reader)."""
    import gguf
    from transformers import AutoModelForCausalLM

    from llama_cpp_gguf import write_llama_cpp_gguf

    root, ids = tmp_path_factory.mktemp("gguf"), torch.tensor([prompts()[1]])
    mixtral = write_llama_cpp_gguf(models["mixtral"][1].parent / "mixtral-hf", root / "mixtral.gguf",
                                   gguf.MODEL_ARCH.LLAMA)
    qwen = write_llama_cpp_gguf(models["qwen3_moe"][1].parent / "qwen3_moe-hf", root / "qwen3_moe.gguf",
                                gguf.MODEL_ARCH.QWEN3MOE, expert_type=gguf.GGMLQuantizationType.Q8_0)
    # transformers' GGUF reader skips expert_feed_forward_length (its default is Qwen3-30B-A3B's): given here
    qwen_hf = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=qwen.name, dtype=torch.float32,
                                                   moe_intermediate_size=MODELS["qwen3_moe"][2]["moe_intermediate_size"])
    qwen_hf.eval()
    assert qwen_hf.config.norm_topk_prob
    with torch.no_grad():
        return {"mixtral gguf": (mixtral, models["mixtral"][2], models["mixtral"][0](ids).logits),
                "qwen3_moe gguf": (qwen, [hf_greedy(qwen_hf, p, GEN_STEPS) for p in prompts()],
                                   qwen_hf(ids).logits)}


@pytest.mark.parametrize("name", ["mixtral gguf", "qwen3_moe gguf"])
def test_llama_cpp_gguf_equals_its_oracle(name, gguf_models):
    """llama.cpp's stacked experts split per expert, q/k in each architecture's layout, the moe config from the
    metadata; Q8_0 experts kept in their blocks."""
    from accessory.model.meta import MetaModel

    path, tokens, logits = gguf_models[name]
    model = MetaModel.from_pretrained(str(path), max_seq_len=128)
    assert model.llama_type == name.split()[0]
    assert greedy_ids(model, prompts(), GEN_STEPS) == tokens
    with torch.no_grad():
        torch.testing.assert_close(model.llma(torch.tensor([prompts()[1]])), logits, atol=1e-4, rtol=1e-4)
    if name == "qwen3_moe gguf":
        assert model.llma.quantization["layers.1.feed_forward.experts.7.w2.weight"] == "int8"


# ---- one rank ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_equals_transformers_greedy_tokens(name, models):
    """Tokens, and the logits too: greedy tokens alone do not tell Qwen3-MoE's unrenormalised router weights from
    renormalised ones."""
    from accessory.model.meta import MetaModel

    hf, folder, expected = models[name]
    model = MetaModel.from_pretrained(str(folder), max_seq_len=128)
    assert greedy_ids(model, prompts(), GEN_STEPS) == expected
    ids = torch.tensor([prompts()[1]])
    with torch.no_grad():
        torch.testing.assert_close(model.llma(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_an_hf_folder_loads_directly(models, tmp_path, monkeypatch):
    """`from_pretrained` of the Qwen3-MoE HF folder itself (imported once into the cache)."""
    from accessory.model.meta import MetaModel

    monkeypatch.setenv("ACCESSORY_CACHE", str(tmp_path))
    _, folder, expected = models["qwen3_moe"]
    model = MetaModel.from_pretrained(str(folder.parent / "qwen3_moe-hf"), max_seq_len=128)
    assert model.llama_type == "qwen3_moe" and greedy_ids(model, prompts(), GEN_STEPS) == expected


def test_compiled_equals_transformers(models):
    """The compiled decode step (static dispatch: a batch of 2 rows makes 4 choices, all 4 experts run) and the
    compiled batch-1 step (2 choices < 4 experts: the chosen experts' weights gathered by id)."""
    from accessory.model.meta import MetaModel

    _, folder, expected = models["mixtral"]
    model = MetaModel.from_pretrained(str(folder), max_seq_len=128, compile=True)
    # batch 1 first: a compiled engine that ran 2 rows then runs 1 fails in the KV cache's size check (any model)
    assert [greedy_ids(model, [ids], GEN_STEPS)[0] for ids in prompts()] == expected
    assert greedy_ids(model, prompts(), GEN_STEPS) == expected
    # the compiled step's logits equal eager decode's at 1 row (gathered) and 2 (all experts): the tokens alone
    # hardly depend on the experts in so small a model
    from accessory.network.components import Segment, decode_mask
    from accessory.network.kv_caches import KVCaches

    llma, ids = model.llma, prompts()[1]
    with torch.inference_mode():
        caches = KVCaches.allocate(llma, 2, 128)
        llma.prefill(torch.tensor(ids + ids), [Segment(0, len(ids), 0), Segment(len(ids), len(ids), 1)], caches)
        for rows in (1, 2):
            tokens, positions = torch.tensor([ids[-1], 5][:rows]), torch.full((rows,), len(ids))
            mask = decode_mask(positions, 64)
            torch.testing.assert_close(model.engine.decode_step(tokens, positions, mask, caches),
                                       llma.decode(tokens, positions, mask, caches), atol=1e-4, rtol=1e-4)


def test_accessory_layout_loads(accessory_mixtral, models):
    """The hand-written LLaMA2-Accessory folder at 1 rank; `accessory convert hf` at 2 shards writes that layout."""
    _, folder = accessory_mixtral
    assert our_tokens(folder) == models["mixtral"][2]
    ours = models["mixtral"][1]
    for rank in range(2):
        name = f"consolidated.{rank:02d}-of-02.model.pth"
        theirs = torch.load(folder / name, weights_only=True, mmap=True)
        mine = torch.load(ours / name, weights_only=True, mmap=True)
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[key], theirs[key]) for key in theirs)


def test_reshard_two_four_one(accessory_mixtral, tmp_path):
    """2 -> 4 -> 1 shards on disk: at 4, shard r holds expert r alone (whole) and the router; at 1, every tensor is
    the original's."""
    from accessory.checkpoint.reshard import reshard

    imported, folder = accessory_mixtral
    four = reshard(folder, tmp_path / "four", 4)
    for rank in range(4):
        shard = torch.load(four / f"consolidated.{rank:02d}-of-04.model.pth", weights_only=True, mmap=True)
        experts = {key.split(".")[5] for key in shard if ".experts." in key}
        assert experts == {str(rank)} and "llma.layers.1.feed_forward.gate.weight" in shard
    one = reshard(four, tmp_path / "one", 1)
    whole = torch.load(one / "consolidated.00-of-01.model.pth", weights_only=True, mmap=True)
    assert sorted(whole) == sorted("llma." + key for key in imported.state_dict)
    assert all(torch.equal(whole["llma." + key], tensor) for key, tensor in imported.state_dict.items())


def test_int8_experts_keep_the_logits(models):
    """quant="int8" quantizes every expert (the router stays float) and runs them through the same kernels."""
    from accessory.model.meta import MetaModel

    folder = models["qwen3_moe"][1]
    ids = torch.tensor([prompts()[1]])
    reference = MetaModel.from_pretrained(str(folder), max_seq_len=128).llma(ids)
    model = MetaModel.from_pretrained(str(folder), max_seq_len=128, quant="int8")
    assert model.llma.quantization["layers.1.feed_forward.experts.7.w2.weight"] == "int8"
    assert "layers.1.feed_forward.gate.weight" not in model.llma.quantization
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(), model.llma(ids).flatten(), dim=0)
    assert cosine > 0.999, cosine


def test_fused_experts_import_as_saved(models):
    """transformers 5 holds a layer's experts fused in memory (experts.gate_up_proj, experts.down_proj) and saves
    them per expert: both forms import to the same tensors."""
    from accessory.checkpoint.importers import read_hf
    from accessory.checkpoint.importers.families import HF_ARCHITECTURES
    from accessory.checkpoint.importers.hf import language_model

    for name in ("mixtral", "qwen3_moe"):
        model, folder, _ = models[name]
        saved = read_hf(folder.parent / f"{name}-hf")
        fused = {key: tensor.detach() for key, tensor in model.state_dict().items()}
        assert any(key.endswith("experts.gate_up_proj") for key in fused)
        family = HF_ARCHITECTURES[model.config.architectures[0]]
        imported = language_model(fused, saved.config, "in memory", "config", family)
        assert imported.keys() == saved.state_dict.keys()
        assert all(torch.equal(imported[key], saved.state_dict[key]) for key in imported)


def test_routing_keeps_tokens_to_their_experts(monkeypatch):
    """Two halves of a batch whose routers pick disjoint experts (0, 1 against 2, 3): each expert multiplies only
    the tokens that chose it, and every dispatch (grouped, the static step's gather at one token and its all-experts
    form at many) gives each half what it gives alone and what the router-weighted sum of the two experts gives."""
    from accessory.network.components import MoEConfig, MoEFeedForward
    from accessory.parallel import ParallelContext

    dim, hidden = 32, 64
    generator = torch.Generator().manual_seed(0)
    moe = MoEFeedForward(dim, hidden, MoEConfig(4, 2), ParallelContext(None, 0, 1, 0))
    moe.fuse()
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    # the router reads feature 0 (experts 0, 1: weights 3, 1) and feature 1 (experts 2, 3)
    moe.gate.weight.zero_()
    moe.gate.weight[[0, 1], 0], moe.gate.weight[[2, 3], 1] = torch.tensor([3.0, 1.0]), torch.tensor([3.0, 1.0])
    x = torch.randn(6, dim, generator=generator) * 0.1
    x[:3, 0], x[3:, 1] = 4.0, 4.0

    def reference(rows: torch.Tensor, experts: tuple[int, int]) -> torch.Tensor:
        probs = torch.softmax(rows @ moe.gate.weight.T, dim=-1)[:, experts]
        outs = []
        for e in experts:
            w = moe.experts[str(e)]
            outs.append((torch.nn.functional.silu(rows @ w.w1.weight.T) * (rows @ w.w3.weight.T)) @ w.w2.weight.T)
        return sum(p[:, None] * out for p, out in zip((probs / probs.sum(-1, keepdim=True)).T, outs))

    from accessory.kernels import dispatch

    seen, product = [], dispatch.expert_product

    def spied(rows, fmt, stack, e):
        if stack[0] is moe.w13.weight:
            seen.append((e, rows.shape[0]))
        return product(rows, fmt, stack, e)

    monkeypatch.setattr(dispatch, "expert_product", spied)
    grouped = moe(x[None])[0]
    assert sorted(seen) == [(0, 3), (1, 3), (2, 3), (3, 3)]  # each expert: its half's 3 tokens, once
    monkeypatch.undo()
    expected = torch.cat([reference(x[:3], (0, 1)), reference(x[3:], (2, 3))])
    torch.testing.assert_close(grouped, expected)
    torch.testing.assert_close(torch.cat([moe(x[:3]), moe(x[3:])]), expected)
    weights, local = moe.route(x)
    for row in (0, 5):  # one token: its two experts in turn; none of them here (another rank's): zeros
        torch.testing.assert_close(moe._grouped(x[row:row + 1], weights[row:row + 1], local[row:row + 1]),
                                   expected[row:row + 1])
        elsewhere = torch.full_like(local[row:row + 1], 4)
        assert torch.equal(moe._grouped(x[row:row + 1], weights[row:row + 1], elsewhere), torch.zeros(1, dim))
    torch.testing.assert_close(moe._static(x, weights, local), expected)  # 12 choices >= 4 experts: all run
    for row in (0, 5):  # 2 choices < 4 experts: the two chosen gathered
        torch.testing.assert_close(moe._static(x[row:row + 1], weights[row:row + 1], local[row:row + 1]),
                                   expected[row:row + 1])


def test_a_bad_moe_config_is_refused(tmp_path):
    from accessory.errors import ConfigError
    from accessory.network.LLM.mixtral import ModelArgs

    with pytest.raises(ConfigError, match="num_experts_per_tok \\(3\\) exceeds num_experts \\(2\\)"):
        ModelArgs.from_dict({"moe": {"num_experts": 2, "num_experts_per_tok": 3}}, "config.json")
    with pytest.raises(ConfigError, match="config.json: moe must be"):
        ModelArgs.from_dict({"moe": {"experts": 8}}, "config.json")


# ---- several ranks: one spawn per rank count ---------------------------------------------------------------------

def tokens_of(folders: dict) -> dict:
    """Each folder's greedy tokens and its logits on the longer prompt (the tokens alone hardly depend on the
    experts in so small a model: a rank computing the wrong experts kept them)."""
    from accessory.model.meta import MetaModel

    out = {}
    for name, folder in folders.items():
        model = MetaModel.from_pretrained(str(folder), max_seq_len=128)
        out[name] = (greedy_ids(model, prompts(), GEN_STEPS), model.llma(torch.tensor([prompts()[1]])))
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_equal_transformers(ranks, models, accessory_mixtral, gguf_models, tmp_path):
    """At 2 ranks: Mixtral's and Qwen3-MoE's experts whole per rank (2 and 4 each), mixtral3's split inside the
    experts; at 4: one and two whole experts per rank, mixtral6 in 2 groups of 2 ranks (3 experts each, split in 2),
    KV heads replicated. The hand-written LLaMA2-Accessory folder at both, and its 4-shard reshard at 4. The
    Qwen3-MoE GGUF (Q8_0 experts, kept) at 2."""
    from accessory.checkpoint.reshard import reshard

    names = ["mixtral", "qwen3_moe", "mixtral3" if ranks == 2 else "mixtral6"]
    folders = {name: models[name][1] for name in names}
    folders["accessory"] = accessory_mixtral[1]
    if ranks == 4:
        folders["four shards"] = reshard(accessory_mixtral[1], tmp_path / "four", 4)
    ids = torch.tensor([prompts()[1]])
    with torch.no_grad():
        expected = {name: (models[name][2], models[name][0](ids).logits) for name in names}
    expected["accessory"] = expected["four shards"] = expected["mixtral"]
    if ranks == 2:
        path, tokens, logits = gguf_models["qwen3_moe gguf"]
        folders["qwen3_moe gguf"], expected["qwen3_moe gguf"] = path, (tokens, logits)
    results = run_ranks(ranks, tokens_of, folders)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        for name in folders:
            tokens, logits = result[name]
            assert tokens == expected[name][0], f"{name} at rank {rank} of {ranks}"
            torch.testing.assert_close(logits, expected[name][1], atol=1e-4, rtol=1e-4, msg=f"{name} at {rank}")


def test_gguf_families_by_architecture_and_experts():
    """llama.cpp writes Mixtral as architecture llama with experts; an architecture is refused with experts it does
    not have (and without those it needs), naming the file."""
    from accessory.checkpoint.importers.families import gguf_family
    from accessory.errors import CheckpointError

    assert gguf_family("llama", 8, "m.gguf").llama_type == "mixtral"
    assert gguf_family("llama", 0, "m.gguf").llama_type == "llama"
    assert gguf_family("qwen3moe", 128, "q.gguf").llama_type == "qwen3_moe"
    with pytest.raises(CheckpointError, match=r"q\.gguf: general\.architecture 'qwen3' with expert_count 8 is not "
                                              r"supported; 'qwen3' files are imported without experts"):
        gguf_family("qwen3", 8, "q.gguf")
    with pytest.raises(CheckpointError, match=r"q\.gguf: general\.architecture 'qwen3moe' with expert_count 0"):
        gguf_family("qwen3moe", 0, "q.gguf")


def test_inspect_says_which_experts_each_shard_and_rank_holds(accessory_mixtral, models, capsys):
    from accessory.checkpoint.inspect import inspect_checkpoint
    from accessory.cli import main

    report = inspect_checkpoint(accessory_mixtral[1], ranks=4)
    assert not report.problems, report.problems
    assert report.experts == {"num_experts": 4, "per_token": 2,
                              "shards": ["consolidated.00-of-02.model.pth: experts 0-1, whole",
                                         "consolidated.01-of-02.model.pth: experts 2-3, whole"],
                              "ranks": [f"rank {r}: experts {r}, whole" for r in range(4)]}
    split = inspect_checkpoint(models["mixtral3"][1], ranks=6).experts  # 3 experts on 2 shards: each cut in 2
    assert split["shards"] == [f"consolidated.0{r}-of-02.model.pth: experts 0-2, 50 of 100 hidden units each"
                               for r in range(2)]
    assert split["ranks"][:2] == ["rank 0: experts 0, hidden-unit slice 1 of 2",
                                  "rank 1: experts 0, hidden-unit slice 2 of 2"]
    main(["inspect", str(accessory_mixtral[1]), "--ranks", "2"])  # healthy: returns
    out = capsys.readouterr().out
    assert "experts:     4, 2 per token\n  consolidated.00-of-02.model.pth: experts 0-1, whole" in out
    assert "  rank 1: experts 2-3, whole" in out


def test_delta_extract_and_apply_across_expert_layouts(accessory_mixtral, tmp_path):
    """A fine-tune saved at 4 shards (expert r in shard r), its delta against the 2-shard base extracted at 1 shard,
    applied back at 4: every tensor equals the fine-tune's, and the base with the delta stacked on it loads as the
    fine-tune does."""
    from accessory.checkpoint.delta import apply_delta, extract_delta
    from accessory.checkpoint.reshard import reshard
    from accessory.model.meta import MetaModel

    base = accessory_mixtral[1]
    tuned = reshard(base, tmp_path / "tuned", 4)
    generator = torch.Generator().manual_seed(3)
    expert, router = "llma.layers.1.feed_forward.experts.3.w2.weight", "llma.layers.0.feed_forward.gate.weight"
    router_change = 0.5 * torch.randn(4, 64, generator=generator)  # the router is whole in every shard
    for rank in range(4):
        path = tuned / f"consolidated.{rank:02d}-of-04.model.pth"
        shard = torch.load(path, weights_only=True)
        shard[router] = shard[router] + router_change
        if expert in shard:  # in shard 3 alone
            shard[expert] = shard[expert] + 0.5 * torch.randn(shard[expert].shape, generator=generator)
        torch.save(shard, path)
    delta = extract_delta(base, tuned, tmp_path / "delta", shards=1, dtype=torch.float32)
    applied = apply_delta(base, delta, tmp_path / "applied", shards=4)
    for rank in range(4):
        name = f"consolidated.{rank:02d}-of-04.model.pth"
        want = torch.load(tuned / name, weights_only=True)
        got = torch.load(applied / name, weights_only=True)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    ids = torch.tensor([prompts()[1]])
    with torch.no_grad():
        stacked = MetaModel.from_pretrained([str(base), str(delta)], max_seq_len=128).llma(ids)
        expected = MetaModel.from_pretrained(str(tuned), max_seq_len=128).llma(ids)
        original = MetaModel.from_pretrained(str(base), max_seq_len=128).llma(ids)
    torch.testing.assert_close(stacked, expected, atol=1e-5, rtol=1e-5)
    assert (expected - original).abs().max() > 1e-2  # the fine-tune moved the logits


def test_the_engine_serves_a_mixture(models, tmp_path):
    """Qwen3-MoE through the server's GenerationService: JSON-schema output from sampled rows decoding together, each
    valid; the prefix cache copies a prompt's shared prefix from a row beside it and keeps the tokens it gives alone;
    `accessory quantize` writes int8 experts (from the 2-shard Mixtral, at 1 shard) that load as quant="int8" does."""
    import json

    import jsonschema

    from accessory.checkpoint.quantize import quantize_checkpoint
    from accessory.generation.constraints import Constraint
    from accessory.model.meta import MetaModel
    from test_constraints import SCHEMA, complete
    from test_families import ReusedCounted

    model = MetaModel.from_pretrained(str(models["qwen3_moe"][1]), max_seq_len=256, max_batch_size=4)
    for final in complete(model, Constraint.json_schema(SCHEMA), seeds=range(3)):
        assert final.finish_reason == "stop", final
        jsonschema.validate(json.loads(final.text), SCHEMA)
    first = prompts()[1]
    second = first[:20] + [11, 12, 13]
    ReusedCounted.tokens = 0
    together = greedy_ids(model, [first, second], GEN_STEPS, engine=ReusedCounted(model.engine))
    assert ReusedCounted.tokens == 20
    assert together == [greedy_ids(model, [p], GEN_STEPS, engine=model.engine.configured(prefix_cache=False))[0]
                        for p in (first, second)]
    quantized = quantize_checkpoint(models["mixtral"][1], tmp_path / "int8", "int8", shards=1)
    ids = torch.tensor([prompts()[1]])
    with torch.no_grad():
        from_disk = MetaModel.from_pretrained(str(quantized), max_seq_len=128)
        at_load = MetaModel.from_pretrained(str(models["mixtral"][1]), max_seq_len=128, quant="int8")
        assert from_disk.llma.quantization["layers.0.feed_forward.experts.3.w1.weight"] == "int8"
        torch.testing.assert_close(from_disk.llma(ids), at_load.llma(ids))
