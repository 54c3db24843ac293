"""Sharded-versus-single-process parity: every tiny checkpoint (saved as 1, 2 and 3 shards) loaded at every rank
count its head counts allow (1, 2, 3, 4) gives the logits of the single-process run within 1e-5 and the same 16
greedy tokens, identical on every rank. Pins resharding N -> M when neither divides the other, uneven splits, and
KV-head replication when ranks outnumber KV heads. (Uneven head splits: tests/network/test_uneven_heads.py.)"""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from tiny import TINY_CONFIGS, greedy_ids

RANK_COUNTS = (1, 2, 3, 4)
GEN_STEPS = 16
PROMPTS = ["The quick brown fox", "Tensor parallel inference is"]


def allowed(config_name: str, world: int) -> bool:
    from accessory.network.LLM.llama import ModelArgs

    return ModelArgs(**TINY_CONFIGS[config_name]).parallel_size_problem(world) is None


def run_all(folders: dict) -> dict:
    """On one rank: logits and greedy tokens for every checkpoint this world size allows."""
    import torch.distributed as dist

    from accessory.model.meta import MetaModel

    world = dist.get_world_size() if dist.is_initialized() else 1
    results = {}
    for (name, shards), folder in folders.items():
        if not allowed(name, world):
            continue
        model = MetaModel.from_pretrained(folder, max_seq_len=128)
        prompts = [model.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
        width = min(map(len, prompts))
        logits = model.llma(torch.tensor([p[:width] for p in prompts]))
        results[name, shards] = (logits, greedy_ids(model, prompts, GEN_STEPS))
    return results


@pytest.fixture(scope="module")
def results(tiny_checkpoints) -> dict:
    """{world: [rank results]} — one spawn per world size, every checkpoint inside it."""
    out = {1: [run_all(tiny_checkpoints)]}
    for world in RANK_COUNTS[1:]:
        out[world] = run_ranks(world, run_all, tiny_checkpoints)
        for rank_result in out[world]:
            if isinstance(rank_result, Exception):
                raise AssertionError(rank_result.rank_traceback)
    return out


CASES = [(name, shards, world) for name in TINY_CONFIGS for shards in (1, 2, 3) for world in RANK_COUNTS
         if allowed(name, shards) and allowed(name, world)]


@pytest.mark.parametrize("name,shards,world", CASES, ids=[f"{n}-{s}shards-{w}ranks" for n, s, w in CASES])
def test_logits_and_greedy_tokens_match_single_process(results, name, shards, world):
    ref_logits, ref_tokens = results[1][0][name, 1]
    for rank, rank_results in enumerate(results[world]):
        logits, tokens = rank_results[name, shards]
        assert (logits - ref_logits).abs().max().item() < 1e-5, f"rank {rank}"
        assert tokens == ref_tokens, f"rank {rank} generated other tokens"
        assert all(len(row) == GEN_STEPS for row in tokens)


def test_cases_cover_uneven_resharding_and_kv_replication():
    pairs = {(n, s, w) for n, s, w in CASES}
    assert ("mha", 2, 3) in pairs and ("mha", 3, 2) in pairs and ("mha", 3, 4) in pairs  # neither divides
    assert ("gqa", 1, 4) in pairs and ("gqa", 2, 4) in pairs  # 4 ranks > 2 KV heads


def test_greedy_choices_are_clear(tiny_checkpoints):
    """The tiny weights give top-1 / top-2 logit gaps far above 1e-5, so token equality is a real check."""
    from accessory.model.meta import MetaModel

    for name in TINY_CONFIGS:
        model = MetaModel.from_pretrained(tiny_checkpoints[name, 1], max_seq_len=128)
        logits = model.llma(torch.tensor([model.tokenizer.encode(PROMPTS[0], bos=True, eos=False)]))
        top2 = logits.topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min().item() > 1e-3, name


@pytest.mark.parametrize("world", [3])
def test_disallowed_rank_count_is_refused_by_name(tiny_checkpoints, world):
    from accessory.model.meta import MetaModel

    errors = run_ranks(world, MetaModel.from_pretrained, tiny_checkpoints["gqa", 1])
    for error in errors:
        assert "model-parallel size (3) is more than n_kv_heads (2) but not a multiple of it" in str(error), error
        assert "[1, 2, 4, 6, 8, 12]" in str(error)
