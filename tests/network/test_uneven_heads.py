"""Uneven head splits: whole GQA groups spread over a rank count that does not divide them (3 KV heads at 2 ranks: 2
groups and 1), and each KV head's query heads split unevenly over its copies when ranks outnumber KV heads.

Oracles: hand-computed placements, allowed rank counts and the FFN split that evens them out; the single-process run
(logits within 1e-5 in float, 1e-4 quantized, the same greedy tokens) of a tiny model saved as 2 uneven shards and
resharded to 1 and 3 (the weights unchanged, bit for bit), in float, int8 and int4 (on load, and kept by
`quantize_checkpoint`), and as a llama_peft model with LoRA factors and biases; transformers' greedy tokens for every
family (qwen2 biases, qwen3 and gemma3 q/k norms, mistral and gemma3 windows) with 3 KV heads at 2 ranks; 2 KV heads
copied at 4 ranks with their 3 query heads split 2 and 1 (saved so, resharded to 1 bit for bit, one process's
logits). SmolLM2 at 2 ranks: tests/model/test_real_model.py (against transformers, like its 1 and 3 ranks)."""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import tokenizer_copy
from distributed import run_ranks
from test_hf_oracle import converted_hf_models
from test_peft import RANK, peft_state_dict
from tiny import BASE, FAMILY_CONFIGS, build_tiny_family, greedy_ids, tiny_state_dict

# head_dim 32 and dim 192 split on whole int4/int8 groups of 32 at 1, 2 and 3 ranks (wo's inputs, the embedding's)
UNEVEN = dict(BASE, dim=192, n_heads=6, n_kv_heads=3, hidden_dim=128, rope_theta=10000.0)
FAMILY_CHANGES = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
PROMPTS = [[1, 415, 2936, 17354, 1701, 29916, 432], [1, 323, 6073, 8943, 27262, 338, 263, 982, 304]]
GEN_STEPS = 12


def test_placements_are_whole_groups_spread_unevenly():
    from accessory.parallel import head_placement, make_shard

    smollm2 = [head_placement(9, 3, 2, rank) for rank in range(2)]  # 9 heads, 3 KV heads, 2 ranks
    assert [(p.heads, p.kv_heads) for p in smollm2] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    # 8 ranks, 2 KV heads of 6 query heads: each KV head copied on 4 ranks, its query heads split 2, 2, 1, 1
    copies = [head_placement(12, 2, 8, rank) for rank in range(8)]
    assert [p.heads for p in copies] == [range(0, 2), range(2, 4), range(4, 5), range(5, 6), range(6, 8),
                                         range(8, 10), range(10, 11), range(11, 12)]
    assert [p.kv_heads for p in copies] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    # an even split is fairscale's, as before: 12 heads at 3 ranks, 2 KV heads copied at 4 ranks
    assert [head_placement(12, 12, 3, r).heads for r in range(3)] == [
        range(make_shard(0, 12, 3, r).start, make_shard(0, 12, 3, r).stop) for r in range(3)]
    assert [head_placement(12, 2, 4, r).kv_heads for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2


def test_the_feed_forward_is_split_evenly_beside_uneven_heads():
    """SmolLM2 at 2 ranks (heads 6 and 3): its 1536 hidden units still go 768 and 768. The attention and the FFN
    each end in an all-reduce, so units moved to the rank with fewer heads would make the other rank wait at the
    FFN's all-reduce while it still waits at the attention's."""
    from accessory.network.LLM.llama import ModelArgs, TransformerBlock
    from accessory.parallel import ParallelContext

    args = ModelArgs(dim=576, n_heads=9, n_kv_heads=3, hidden_dim=1536)
    with torch.device("meta"):
        blocks = [TransformerBlock(args, ParallelContext(None, rank, 2, 0)) for rank in range(2)]
    assert [b.attention.n_local_heads for b in blocks] == [6, 3]
    assert [(b.feed_forward.w1.weight_shard.start, b.feed_forward.w1.weight_shard.stop) for b in blocks] == [
        (0, 768), (768, 1536)]
    assert [b.feed_forward.w2.weight.shape[1] for b in blocks] == [768, 768]


def test_allowed_rank_counts_and_refusals_name_the_numbers():
    from accessory.errors import ConfigError
    from accessory.network.LLM.llama import ModelArgs

    smollm2 = ModelArgs(dim=576, n_heads=9, n_kv_heads=3)
    assert smollm2.allowed_parallel_sizes(16) == [1, 2, 3, 6, 9]
    with pytest.raises(ConfigError, match=r"model-parallel size \(4\) is more than n_kv_heads \(3\) but not a "
                                          r"multiple of it.*runs at \[1, 2, 3, 6, 9\] ranks"):
        smollm2.check_parallel_size(4)
    assert "n_heads (9) is less than the model-parallel size (12)" in smollm2.parallel_size_problem(12)
    assert "dim (100) is not divisible by the model-parallel size (3)" in ModelArgs(
        dim=100, n_heads=5, n_kv_heads=5).parallel_size_problem(3)


def test_int4_refuses_a_head_split_off_its_groups_by_name():
    """wo's inputs split at head boundaries: 5 heads of 16 at 2 ranks (3 and 2) put rank 1's inputs at [48, 80),
    not on int4's groups of 32: refused, naming the inputs and the heads."""
    from accessory.errors import ConfigError
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.parallel import ParallelContext

    args = ModelArgs(**dict(BASE, dim=64, n_heads=5, n_kv_heads=5, head_dim=16, hidden_dim=64))
    with torch.device("meta"):
        model = Transformer(args, ParallelContext(None, 1, 2, 0))
    with pytest.raises(ConfigError, match=r"layers.0.attention.wo.weight as int4: .*inputs \[48, 80\) of 80 at 2 "
                                          r"model-parallel ranks .*whole attention heads"):
        model.quantize_(model.quantization_plan("int4"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, llama_tokenizer) -> dict:
    """name -> checkpoint folder: the tiny uneven model saved as 2 shards, resharded to 1 and 3; kept int4 (from
    the 2 shards, then as 3); llama_peft with LoRA and biases (2 shards); every family converted as 2 shards."""
    from accessory.checkpoint.quantize import quantize_checkpoint
    from accessory.checkpoint.reshard import reshard
    from accessory.checkpoint.save import save_checkpoint

    root = tmp_path_factory.mktemp("uneven")
    tokenizer = [tokenizer_copy(llama_tokenizer, root)]
    state_dict = tiny_state_dict(UNEVEN)
    out = {"two": save_checkpoint(root / "two", state_dict, UNEVEN, 2, tokenizer)}
    out["one"], out["three"] = reshard(out["two"], root / "one", 1), reshard(out["two"], root / "three", 3)
    out["back"] = reshard(out["three"], root / "back", 1)
    out["int4-kept"] = reshard(quantize_checkpoint(out["two"], root / "int4-two", "int4"), root / "int4-kept", 3)
    out["peft"] = save_checkpoint(root / "peft", peft_state_dict(state_dict, biases=True),
                                  dict(UNEVEN, lora_rank=RANK, bias_tuning=True), 2, tokenizer,
                                  llama_type="llama_peft")
    build = functools.partial(build_tiny_family, **FAMILY_CHANGES)
    families = converted_hf_models(FAMILY_CONFIGS, build, root, llama_tokenizer, PROMPTS, GEN_STEPS)
    out["families"] = {family: (folder, hf_tokens) for family, (_, folder, hf_tokens) in families.items()}
    out["state_dict"] = state_dict
    return out


def test_resharding_uneven_shards_keeps_every_weight(folders):
    for name in ("one", "back"):  # 2 uneven shards -> 1, and -> 3 -> 1
        [path] = folders[name].glob("consolidated.*.pth")
        saved = torch.load(path, weights_only=True)
        assert {k.removeprefix("llma."): v for k, v in saved.items()}.keys() == folders["state_dict"].keys()
        for key, value in saved.items():
            assert torch.equal(value, folders["state_dict"][key.removeprefix("llma.")]), (name, key)


VARIANTS = {"float-1-shard": ("one", None), "float-2-shards": ("two", None), "float-3-shards": ("three", None),
            "int8": ("two", "int8"), "int4": ("three", "int4"), "int4-kept": ("int4-kept", "int4"),
            "peft": ("peft", None)}


def run_every_model(folders: dict) -> dict:
    """On one rank: each variant's logits and greedy tokens, each family's greedy tokens."""
    from accessory.model.meta import MetaModel

    out = {}
    for variant, (name, quant) in VARIANTS.items():
        model = MetaModel.from_pretrained(folders[name], max_seq_len=64, quant=quant)
        width = min(map(len, PROMPTS))
        out[variant] = (model.llma(torch.tensor([p[:width] for p in PROMPTS])), greedy_ids(model, PROMPTS, GEN_STEPS))
    for family, (folder, _) in folders["families"].items():
        out[family] = greedy_ids(MetaModel.from_pretrained(folder, max_seq_len=64), PROMPTS, GEN_STEPS)
    return out


@pytest.fixture(scope="module")
def results(folders) -> dict:
    """{ranks: [each rank's run_every_model]} at 1 (this process) and 2 ranks."""
    inputs = {key: value for key, value in folders.items() if key != "state_dict"}
    two = run_ranks(2, run_every_model, inputs)
    for result in two:
        assert not isinstance(result, Exception), result.rank_traceback
    return {1: [run_every_model(inputs)], 2: two}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_equal_one_process(results, variant):
    """Every variant at 2 ranks (groups 2 and 1) and at 1 gives one process's logits and tokens from 1 shard (the
    quantized ones: that format's)."""
    reference = "float-1-shard" if variant.startswith("float") else variant
    ref_logits, ref_tokens = results[1][0][reference]
    tolerance = 1e-5 if variant.startswith("float") or variant == "peft" else 1e-4
    for ranks, rank_results in results.items():
        for rank, result in enumerate(rank_results):
            logits, tokens = result[variant]
            assert (logits - ref_logits).abs().max().item() < tolerance * ref_logits.abs().max().item(), (ranks, rank)
            assert tokens == ref_tokens, f"{variant}: rank {rank} of {ranks}"


def test_the_variants_differ(results):
    """Quantization and the adapter change the logits far beyond the tolerances above, so each comparison is of its
    own model."""
    float_logits = results[1][0]["float-1-shard"][0]
    for variant in ("int8", "int4", "int4-kept", "peft"):
        logits = results[1][0][variant][0]
        assert (logits - float_logits).abs().max().item() > 1e-3 * float_logits.abs().max().item(), variant


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_every_family_at_two_ranks_equals_transformers(results, folders, family):
    _, hf_tokens = folders["families"][family]
    for ranks, rank_results in results.items():
        for rank, result in enumerate(rank_results):
            assert result[family] == hf_tokens, f"{family}: rank {rank} of {ranks}"


def test_cache_sizes_are_the_same_on_every_rank():
    """Rows kept for the prefix cache and a cache kept between runs are decided from these, alike on every rank:
    sized for rank 0's 2 KV heads (of 32 numbers) on both ranks, 2 layers of keys and values in float32."""
    from accessory.network.LLM.llama import ModelArgs, Transformer
    from accessory.network.kv_caches import KVCaches
    from accessory.parallel import ParallelContext

    sizes = []
    for rank in range(2):
        with torch.device("meta"):
            model = Transformer(ModelArgs(**UNEVEN), ParallelContext(None, rank, 2, 0))
        sizes.append(KVCaches.row_nbytes(model, 256))
    assert sizes == [2 * 2 * 32 * 256 * 2 * 4] * 2


# 2 KV heads of 3 query heads each: at 4 ranks each KV head is copied on 2 ranks, its query heads split 2 and 1
COPIED = dict(UNEVEN, n_kv_heads=2)


def logits_and_tokens(folder) -> tuple:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=64)
    width = min(map(len, PROMPTS))
    return model.llma(torch.tensor([p[:width] for p in PROMPTS])), greedy_ids(model, PROMPTS, GEN_STEPS)


def test_copied_kv_heads_with_query_heads_split_unevenly(tmp_path, llama_tokenizer):
    """Saved as 4 shards (each KV head in 2 of them), resharded to 1 bit for bit; loaded at 4 ranks: one process's
    logits and tokens."""
    from accessory.checkpoint.reshard import reshard
    from accessory.checkpoint.save import save_checkpoint

    state_dict = tiny_state_dict(COPIED)
    four = save_checkpoint(tmp_path / "four", state_dict, COPIED, 4, [tokenizer_copy(llama_tokenizer, tmp_path)])
    one = reshard(four, tmp_path / "one", 1)
    [path] = one.glob("consolidated.*.pth")
    saved = torch.load(path, weights_only=True)
    assert all(torch.equal(value, state_dict[key.removeprefix("llma.")]) for key, value in saved.items())
    ref_logits, ref_tokens = logits_and_tokens(one)
    for rank, (logits, tokens) in enumerate(run_ranks(4, logits_and_tokens, four)):
        assert (logits - ref_logits).abs().max().item() < 1e-5 * ref_logits.abs().max().item(), rank
        assert tokens == ref_tokens, f"rank {rank}"
