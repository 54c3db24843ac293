"""Sampling from slices of the vocabulary (generation/vocab_slices.py): ranks that each hold a slice of the same logits
draw the same tokens, with the same log-probs, as the whole vocabulary in one slice (what one rank runs, the gathered
path): greedy, temperature alone, top-k, top-p (a flat row that needs more candidates too), min-p, log-probs,
repetition / presence / frequency penalties, logit bias and a grammar's mask. The one slice against hand-computed
values; what crosses ranks; and seeded sampling by a real model alike at 1, 2 and 3 ranks."""
from __future__ import annotations

import math

import pytest
import torch

from distributed import run_ranks

VOCAB = 1000
STEPS = 8
PROMPT = [5, 17, 17, 230, 999]


def params_of_rows():
    from accessory.generation.sampling import SamplingParams as P

    return [P(), P(repetition_penalty=1.3, logit_bias=((3, 5.0), (998, -100.0))),  # greedy, adjusted greedy
            P(temperature=0.9, top_k=20, logprobs=5), P(temperature=1.0, top_p=0.9),
            P(temperature=4.0, top_p=0.95),  # flat: its nucleus holds hundreds of tokens
            P(temperature=0.7, min_p=0.2, top_p=1.0), P(temperature=1.2, top_p=1.0),  # every token kept
            P(temperature=0.8, top_p=0.8, presence_penalty=1.5, frequency_penalty=0.5, logprobs=0),
            P(temperature=0.0, logprobs=3)]


CONSTRAINED = 3  # this row's grammar allows even ids only
TARGETS = [0, 999, 499, 500, 333, 334, 667, 668, 17]  # a prompt's next tokens at 9 positions: slices' ends


def step_logits(step: int) -> torch.Tensor:
    """(rows, 1, vocab): the same on every rank."""
    generator = torch.Generator().manual_seed(step)
    return torch.randn(len(params_of_rows()), 1, VOCAB, generator=generator) * 3


def even_ids_mask() -> torch.Tensor:
    bits = torch.zeros(1, 1, -(-VOCAB // 32), dtype=torch.int64)
    for token in range(0, VOCAB, 2):
        bits[..., token // 32] |= 1 << (token % 32)
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)


def draw_in_slices() -> dict:
    """STEPS steps of every row, this rank holding its slice: each step's (token, log-prob) per row, and the widest
    record sent (k) in each step's rounds."""
    import torch.distributed as dist

    from accessory.generation.sampling import sample
    from accessory.generation.scheduler import token_logprob
    from accessory.generation.sampling import MAX_LOGPROBS
    from accessory.generation.vocab_slices import RowRule, VocabSlice, slice_logprobs
    from accessory.parallel import ParallelContext

    ctx = ParallelContext.from_group(None) if dist.is_initialized() else ParallelContext(None, 0, 1, 0)
    size = -(-VOCAB // ctx.world_size)
    start = min(ctx.rank * size, VOCAB)
    vocab = VocabSlice(ctx, range(start, min(start + size, VOCAB)), size, VOCAB, torch.device("cpu"))
    params = params_of_rows()
    vocab.admit([RowRule(p, row == CONSTRAINED) for row, p in enumerate(params)], [PROMPT] * len(params))
    rounds, records = [], vocab._records

    def counted(z, adjusted, layout):
        rounds[-1].append(layout.k)
        return records(z, adjusted, layout)

    vocab._records = counted
    generators = [torch.Generator().manual_seed(100 + row) for row in range(len(params))]
    steps = []
    for step in range(STEPS):
        local = local_slice(step_logits(step), start, size)
        rounds.append([])
        merged = vocab.reduce(local, [()] * len(params), even_ids_mask() if ctx.is_source else None)
        chosen = []
        for row, p in enumerate(params):
            candidates = merged.at(row, 0)
            token = sample(candidates, p, generators[row])
            logprob = token_logprob(candidates, token, p.logprobs) if p.logprobs is not None else None
            chosen.append((token, logprob))
        chosen = ctx.broadcast_object(chosen)  # the source rank's, as the plans carry them
        vocab.observe([((token,), 0) for token, _ in chosen])
        steps.append(chosen)
    prompt = local_slice(step_logits(STEPS)[:, 0], start, size)  # 9 positions of a prompt scored (echo)
    scores = slice_logprobs(ctx, prompt, vocab.tokens, torch.tensor(TARGETS), MAX_LOGPROBS)
    return {"steps": steps, "rounds": rounds, "prompt": scores}


def local_slice(logits: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """A rank's columns start..start + size of logits (..., VOCAB), the last slice's tail padded."""
    local = logits[..., start:start + size]
    return torch.nn.functional.pad(local, (0, size - local.shape[-1]))


def check_prompt_logprobs(scores) -> None:
    """Against log_softmax over the whole vocabulary, in float64."""
    logprobs = torch.log_softmax(step_logits(STEPS)[:, 0].double(), dim=-1)
    assert scores.chosen.double().tolist() == pytest.approx(logprobs[range(len(TARGETS)), TARGETS].tolist(), abs=1e-5)
    best = logprobs.topk(20, dim=-1)
    assert scores.top_ids.tolist() == best.indices.tolist()
    assert torch.allclose(scores.top_logprobs.double(), best.values, atol=1e-5)


@pytest.fixture(scope="module")
def whole():
    return draw_in_slices()


@pytest.mark.parametrize("world", [2, 3])
def test_slices_draw_the_tokens_and_log_probs_of_the_whole_vocabulary(whole, world):
    """And a prompt's log-probabilities (echo), from records of 42 floats a position and rank."""
    for rank, result in enumerate(run_ranks(world, draw_in_slices)):
        assert not isinstance(result, Exception), result.rank_traceback
        check_prompt_logprobs(result["prompt"])
        for step, (mine, theirs) in enumerate(zip(result["steps"], whole["steps"])):
            assert [token for token, _ in mine] == [token for token, _ in theirs], f"rank {rank}, step {step}"
            for (_, logprob), (_, expected) in zip(mine, theirs):
                if expected is not None:
                    assert logprob.logprob == pytest.approx(expected.logprob, abs=1e-5)
                    assert [t for t, _ in logprob.top] == [t for t, _ in expected.top]
                    assert [v for _, v in logprob.top] == pytest.approx([v for _, v in expected.top], abs=1e-5)


def test_one_slice_against_hand_computed_values(whole):
    """Greedy rows are the argmax of the adjusted logits, log-probs the raw log_softmax's, the grammar row's tokens
    even; only the rows that keep every token, or more than 64, made the records wider than 64."""
    from accessory.generation.sampling import Penalties

    check_prompt_logprobs(whole["prompt"])
    params = params_of_rows()
    penalties = Penalties(params[1], PROMPT, range(VOCAB), torch.device("cpu"))
    for step, chosen in enumerate(whole["steps"]):
        logits = step_logits(step)[:, 0]
        assert chosen[0][0] == int(logits[0].argmax())
        assert chosen[1][0] == int(penalties.apply(logits[1]).argmax())
        penalties.observe(chosen[1][0])
        assert chosen[CONSTRAINED][0] % 2 == 0
        raw = torch.log_softmax(logits, dim=-1)
        for row in (2, 7, 8):
            token, logprob = chosen[row]
            assert logprob.logprob == pytest.approx(float(raw[row, token]), abs=1e-5)
            assert [t for t, _ in logprob.top] == raw[row].topk(params[row].logprobs).indices.tolist()
        assert chosen[8][0] == int(logits[8].argmax())
    assert all(rounds[0] == 64 and rounds[-1] == VOCAB for rounds in whole["rounds"])  # rows 5 and 6: every token


def test_a_batch_that_keeps_few_tokens_sends_one_small_round():
    """Greedy, top-k and top-n log-probs: one round of at most top_k candidates a row, never the vocabulary."""
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.vocab_slices import FIRST_CANDIDATES, Layout, RowRule, VocabSlice
    from accessory.parallel import ParallelContext

    vocab = VocabSlice(ParallelContext(None, 0, 1, 0), range(VOCAB), VOCAB, VOCAB, torch.device("cpu"))
    vocab.admit([RowRule(SamplingParams()), RowRule(SamplingParams(logprobs=20))], [PROMPT] * 2)
    assert vocab._first_layout() == Layout(1, 20, raw=True, lse=False)
    vocab.admit([RowRule(SamplingParams(temperature=1.0, top_k=40, top_p=0.9))], [PROMPT])
    sizes = []
    records = vocab._records
    vocab._records = lambda *a: sizes.append(records(*a).shape) or records(*a)
    vocab.reduce(step_logits(0)[:3], [()] * 3, None)
    assert sizes == [(3, 1, Layout(FIRST_CANDIDATES, 20, raw=True, lse=True).width)]


def test_an_empty_slice_makes_the_records_the_general_path_makes():
    """A pipeline stage before the head holds no ids: its records, made without computing anything, equal those the
    general path makes of an empty slice, for every layout (greedy, sampled, log-probs, several slots); and only
    rows that sample or have a grammar need anything back from the source rank."""
    from accessory.generation.sampling import SamplingParams as P
    from accessory.generation.vocab_slices import RowRule, VocabSlice

    for params in ([P()], [P(logprobs=2)], [P(temperature=0.7, top_k=5)], [P(), P(temperature=1.0, logprobs=3)]):
        vocab = VocabSlice(None, range(0), 64, VOCAB, torch.device("cpu"))
        vocab.admit([RowRule(p) for p in params], [PROMPT] * len(params))
        assert vocab.sends_only == all(p.greedy for p in params)
        for slots in (1, 3):
            z = torch.empty(len(params), slots, 0)
            layout = vocab._first_layout()
            assert torch.equal(vocab._records(z, z, layout), vocab._slice_records(z, z, layout))
    vocab.admit([RowRule(P(), constrained=True)], [PROMPT])
    assert not vocab.sends_only


@pytest.mark.parametrize("size", [49152, 151936, 32064, 50257, 64])
def test_row_max_is_torch_max(size):
    """The chunked greedy pick: the same values and first indices as torch's max, with ties (within and across
    chunks), rows of -inf and a NaN (the largest, as in max); a vocabulary of an odd size falls back to max."""
    from accessory.generation.vocab_slices import row_max

    generator = torch.Generator().manual_seed(size)
    for trial in range(20):
        x = torch.randint(-3, 3, (3, 2, size), generator=generator).float()
        x[0, 0] = float("-inf")
        if trial % 4 == 0:
            x[2, 1, trial * 7 % size] = float("nan")
        for view in (x, x[..., :size // 2 * 2][..., ::2]):
            expected, got = view.max(dim=-1, keepdim=True), row_max(view)
            assert torch.equal(got[1], expected.indices)
            assert torch.allclose(got[0], expected.values, equal_nan=True)


def test_a_sampled_row_draws_from_its_kept_tokens_in_proportion():
    """20000 draws of one top-k / min-p row against the softmax over the tokens they keep (chi-square, alpha 1e-4)."""
    from accessory.generation.sampling import SamplingParams, sample
    from accessory.generation.sampling import MAX_LOGPROBS
    from accessory.generation.vocab_slices import RowRule, VocabSlice, slice_logprobs
    from accessory.parallel import ParallelContext

    params = SamplingParams(temperature=0.8, top_k=12, min_p=0.01)
    logits = torch.randn(1, 1, VOCAB, generator=torch.Generator().manual_seed(3))
    vocab = VocabSlice(ParallelContext(None, 0, 1, 0), range(VOCAB), VOCAB, VOCAB, torch.device("cpu"))
    vocab.admit([RowRule(params)], [PROMPT])
    candidates = vocab.reduce(logits, [()], None).at(0, 0)
    generator, counts = torch.Generator().manual_seed(0), torch.zeros(VOCAB)
    for _ in range(20000):
        counts[sample(candidates, params, generator)] += 1
    z = logits[0, 0] / params.temperature
    kept = z.topk(12).indices
    kept = kept[z[kept] - z.max() >= math.log(params.min_p)]
    expected = torch.softmax(z[kept], dim=0) * 20000
    assert counts.sum() == counts[kept].sum()
    chi_square = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi_square < 50.8  # 11 degrees of freedom or fewer, alpha 1e-4: 36.1 at 11


def seeded(folder) -> list[str]:
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    return model.generate(["The quick brown fox", "Once upon a time"], max_gen_len=24, temperature=0.9, top_p=0.9,
                          top_k=3, seed=11)


def test_seeded_sampling_is_the_same_at_1_2_and_3_ranks(tiny_checkpoints):
    """The same draws at every rank count, from candidates that come from different ranks' vocabulary slices. top_k 3:
    the logits at 1, 2 and 3 ranks differ in their last bits (the row-parallel products sum in another order), and
    over a random tiny model's near-flat 32000 tokens such a difference moves a draw across a token's sliver of
    probability every few dozen tokens (seeds 1, 5, 6 and 7 of 1-8 parted so without top_k); three candidates
    hold about a third of the probability each."""
    folder = tiny_checkpoints["mha", 3]
    one = seeded(folder)
    for world in (2, 3):
        results = run_ranks(world, seeded, folder)
        assert all(result == one for result in results), (world, results, one)
