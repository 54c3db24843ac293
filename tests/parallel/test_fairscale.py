"""LLaMA2-Accessory's scripts set up fairscale's model-parallel group before loading:

    fairscale.nn.model_parallel.initialize.initialize_model_parallel(n)
    model = MetaModel.from_pretrained(path)          # no mp_group

from_pretrained then runs on fairscale's group. At 3 gloo ranks: 1 group of 3 ranks, then 3 data-parallel groups of
1 rank each; the oracle is the single-process run of the same checkpoint.
"""
from __future__ import annotations

from distributed import run_ranks
from tiny import greedy_ids

PROMPTS = [[1, 415, 2936, 17354, 1701, 29916], [1, 323, 6073, 8943]]
STEPS = 12


def _load_on_fairscale_groups(folder) -> list:
    """Per model-parallel size: (this rank's model-parallel size, whether its group is fairscale's, tokens)."""
    import fairscale.nn.model_parallel.initialize as fs_init

    from accessory.model.meta import MetaModel
    from accessory.parallel import fairscale_model_parallel_group

    assert fairscale_model_parallel_group() is None  # imported but not set up: the world, as without fairscale
    out = []
    for mp in (3, 1):
        fs_init.initialize_model_parallel(mp)
        model = MetaModel.from_pretrained(folder, max_seq_len=64)
        out.append((model.ctx.world_size, model.ctx.group is fs_init.get_model_parallel_group(),
                    greedy_ids(model, PROMPTS, STEPS)))
        fs_init.destroy_model_parallel()
    return out


def test_from_pretrained_uses_fairscales_model_parallel_group(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    folder = tiny_checkpoints["mha", 1]
    expected = greedy_ids(MetaModel.from_pretrained(folder, max_seq_len=64), PROMPTS, STEPS)
    results = run_ranks(3, _load_on_fairscale_groups, folder)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), getattr(result, "rank_traceback", result)
        assert result == [(3, True, expected), (1, True, expected)], f"rank {rank}"
