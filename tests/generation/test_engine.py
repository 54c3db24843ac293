"""The engine's static decode step and what ranks exchange: compiled and eager decoding give the same tokens at 1
and 3 ranks, the step compiles at most twice while rows join and leave, per-step traffic does not grow with the
output, and text never leaves the source rank."""
from __future__ import annotations

import pickle

import pytest
import torch

from distributed import run_ranks
from tiny import CompiledSteps, greedy_ids

PROMPTS = ["Hi", "The quick brown fox", "Tensor parallel inference is a way to", "Once upon a time there was",
           "Hello there"]
LENGTHS = [9, 3, 14, 6, 11]  # rows finish at different steps, so rows leave and waiting prompts join


def joining_and_leaving(model, compile: bool) -> list[list[int]]:
    """Greedy tokens of PROMPTS, 2 rows at a time with different lengths: the batch changes at many steps."""
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    engine = model.engine.configured(max_batch_size=2, compile=compile)
    engine.stop_ids = set()
    requests = [Request(i, model.tokenizer.encode(p, True, False), SamplingParams(max_gen_len=n), 0)
                for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    for _ in engine.stream(requests):
        pass
    return model.ctx.broadcast_object([r.generated for r in requests])


def compiled_against_eager(folder) -> tuple:
    """(eager tokens, compiled tokens, graphs or packages compiled, ...) on this rank."""
    from accessory.model.meta import MetaModel

    torch._dynamo.reset()
    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    eager = joining_and_leaving(model, compile=False)
    with CompiledSteps() as made:
        compiled = joining_and_leaving(model, compile=True)
        compiled_again = greedy_ids(model, [model.tokenizer.encode(PROMPTS[2], True, False)], 40,
                                    engine=model.engine.configured(compile=True))  # another cache size
    return eager, compiled, made.count, compiled_again, \
        greedy_ids(model, [model.tokenizer.encode(PROMPTS[2], True, False)], 40)


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_decode_gives_the_eager_tokens_and_compiles_at_most_twice(tiny_checkpoints, world):
    """Rows join and leave at many steps (batch of 1 and 2, several attention widths, two cache sizes); the step
    is one graph with symbolic sizes, plus one for a batch of 1 (torch specializes size 1): AOTInductor packages
    (packaged_steps.py), at 2 ranks calling the shared-memory collectives (the 3-shard checkpoint resharded)."""
    folder = tiny_checkpoints["mha", 3]
    results = [compiled_against_eager(folder)] if world == 1 else run_ranks(world, compiled_against_eager, folder)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        eager, compiled, graphs, compiled_again, eager_again = result
        assert compiled == eager, f"rank {rank}"
        assert compiled_again == eager_again, f"rank {rank}"
        assert 1 <= graphs <= 2, f"rank {rank}: {graphs} graphs compiled"
        assert [len(row) for row in eager] == LENGTHS


def traffic_per_step(folder) -> tuple:
    """Bytes this rank's engine exchanges at each step of one long generation (the step header it adds up with the
    other ranks, broadcasts, and its record of its slice of the vocabulary for sampling; the model's all-reduces
    inside a step are the same size at every step of a batch), the texts, and every event this rank's stream
    yielded (each rank detokenizes its own tokens)."""
    from accessory.generation.engine import Engine
    from accessory.generation.vocab_slices import VocabSlice
    from accessory.model.meta import MetaModel
    from accessory.parallel import ParallelContext

    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    steps: list[dict] = []
    count = lambda kind, n: steps[-1].update({kind: steps[-1].get(kind, 0) + n}) if steps else None  # noqa: E731
    originals = {name: getattr(ParallelContext, name) for name in ("sum_in_step", "broadcast_object",
                                                                   "gather_to_source")}
    records = VocabSlice._records

    def sum_in_step(ctx, x):
        count("tensor", x.nbytes)
        return originals["sum_in_step"](ctx, x)

    def broadcast_object(ctx, obj):
        obj = originals["broadcast_object"](ctx, obj)
        count("object", len(pickle.dumps(obj)))
        return obj

    def gather_to_source(ctx, x, dim=-1):
        count("gather", x.nbytes)
        return originals["gather_to_source"](ctx, x, dim)

    def recorded(vocab, *args):
        record = records(vocab, *args)
        count("vocab", record.nbytes)
        return record

    next_plan = Engine._next_plan

    def marked(engine, *args):
        steps.append({})
        return next_plan(engine, *args)

    ParallelContext.sum_in_step, ParallelContext.broadcast_object = sum_in_step, broadcast_object
    ParallelContext.gather_to_source, Engine._next_plan = gather_to_source, marked
    VocabSlice._records = recorded
    model.stop_ids = set()
    events = [(e.text, e.delta) for e in model.stream_generate("The quick brown fox", max_gen_len=100)]
    return steps, events[-1][0], events, scored_prompt(model)


def scored_prompt(model) -> tuple:
    """A prompt scored for its log-probabilities (echo) as a step scores it: what this rank all-gathered meanwhile,
    the prompt's length, and the scores against log_softmax of the gathered logits."""
    from accessory.generation.model_runner import ModelRunner
    from accessory.parallel import ParallelContext

    prompt = tuple(model.tokenizer.encode("The quick brown fox jumps over the lazy dog", True, False))
    runner, gathered, all_gather = ModelRunner(model.engine, 1, 64, keep_finished=False), [], ParallelContext.all_gather

    def counted(ctx, x, dim=-1):
        gathered.append(x.nbytes)
        return all_gather(ctx, x, dim)

    ParallelContext.all_gather = counted
    with torch.inference_mode():
        scores = runner._logprobs(*runner._score(prompt))
        ParallelContext.all_gather = all_gather
        logprobs = torch.log_softmax(model.engine.model.forward(torch.tensor([prompt]))[0, :-1].double(), dim=-1)
    chosen_error = (scores.chosen - logprobs[range(len(prompt) - 1), prompt[1:]]).abs().max().item()
    top = logprobs.topk(scores.top_ids.shape[1], dim=-1)
    return sum(gathered), len(prompt), chosen_error, scores.top_ids.tolist() == top.indices.tolist()


def test_nothing_sent_per_step_grows_with_the_output_and_every_rank_streams_alike(tiny_checkpoints):
    results = run_ranks(2, traffic_per_step, tiny_checkpoints["mha", 2])
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result.rank_traceback
        steps, text, events, (gathered, length, chosen_error, same_top) = result
        assert (text, events) == results[0][1:3] and len(events) > 10  # no text sent: each rank decodes its tokens
        decoding = steps[2:-1]  # after the prompt's prefill, before the last plan
        assert len(decoding) >= 95
        assert all(step == decoding[0] for step in decoding), f"rank {rank}: {decoding[0]} vs {decoding[-1]}"
        assert "object" not in decoding[0], "no pickled plan while the batch does not change"
        assert decoding[0]["tensor"] <= 96  # the step header: status, rows, flags, each row's token and end, places
        # greedy: the slice's largest and its id, to the source rank alone (gathered, not all-gathered)
        assert decoding[0]["vocab"] == 8 and decoding[0]["gather"] == 8
        # a prompt scored (echo with logprobs): log-probabilities of the gathered logits from records of the slices:
        # the embedding's all-gather (96 / 2 features a token) and 42 floats a position, not 16000 logits a position
        assert gathered == length * 48 * 4 + (length - 1) * 42 * 4, f"rank {rank}: {gathered} bytes all-gathered"
        assert chosen_error < 1e-5 and same_top
