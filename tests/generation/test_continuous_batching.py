"""Continuous batching, below the HTTP layer: requests that arrive while others decode join the running batch, a
finished or cancelled row leaves and its place is refilled, each request keeps its own sampling parameters and
seed, every rank runs the same steps, and the service's queue is bounded."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from tiny import StepRows, greedy_ids

PROMPTS = ["Hi", "The quick brown fox", "Tensor parallel inference is a way to", "Once upon a time there was",
           "Hello there"]


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    from accessory.model.meta import MetaModel

    return MetaModel.from_pretrained(tiny_checkpoints["mha", 1], max_seq_len=128)


def request(model, row, prompt, max_gen_len=12, seed=0, **sampling):
    from accessory.generation.sampling import SamplingParams
    from accessory.generation.requests import Request

    return Request(row, model.tokenizer.encode(prompt, True, False), SamplingParams(max_gen_len, **sampling), seed)


def drive(model, arrivals: dict, rows: int, cancels: dict = None):
    """Run the engine on this rank; on the source, add arrivals[step] (requests) and cancel cancels[step] (ids)
    before that step's plan. Returns (the plans every rank ran, the source's requests by id)."""
    engine, cancels = model.engine, cancels or {}
    stop_ids, engine.stop_ids = engine.stop_ids, set()
    scheduler, requests, plans = engine.scheduler(rows), {}, []
    if scheduler is not None:
        step_of = scheduler.step

        def step_with_arrivals(logits, proposals=(), step=iter(range(10 ** 6))):
            now = next(step)
            for r in arrivals.get(now, []):
                requests[r.id] = r
                scheduler.add(r)
            for request_id in cancels.get(now, []):
                scheduler.cancel(request_id)
            if now == max(arrivals):
                scheduler.close()
            return step_of(logits, proposals)

        scheduler.step = step_with_arrivals
    next_plan = engine._next_plan
    engine._next_plan = lambda *args: record(next_plan(*args))  # each plan as every rank received it
    record = lambda plan_and_events: plans.append(plan_and_events[0]) or plan_and_events  # noqa: E731
    try:
        for _ in engine.run(scheduler, rows, 128):
            pass
    finally:
        del engine._next_plan  # the instance attribute: the method again
        engine.stop_ids = stop_ids
    return plans, requests


def test_a_request_arriving_mid_decode_joins_the_running_batch(model):
    first, late = request(model, "a", PROMPTS[2], 16), request(model, "b", PROMPTS[1], 8)
    plans, requests = drive(model, {0: [first], 4: [late]}, rows=4)
    joined = next(plan for plan in plans if plan.joining and plan.keep)  # b prefills while a keeps decoding
    assert joined.keep == (0,) and joined.joining.prompts == (tuple(late.tokens),)
    alone = greedy_ids(model, [first.tokens, late.tokens], 16)
    assert requests["a"].generated == alone[0] and requests["b"].generated == alone[1][:8]
    assert [r.finish_reason for r in requests.values()] == ["length", "length"]


def test_a_finished_row_is_refilled_at_once(model):
    engine = model.engine
    model.engine = engine.configured(max_batch_size=2)
    try:
        with StepRows(model.engine) as sizes:
            texts = model.generate(PROMPTS, max_gen_len=6)
    finally:
        model.engine = engine
    # every row stops after 6 tokens: rows leave in pairs and the next two prompts prefill in the same step
    assert max(sizes) == 2 and texts == [model.generate([p], max_gen_len=6)[0] for p in PROMPTS]
    assert sizes.count(1) == 6  # only the last prompt, alone at the end, runs a batch of 1 (prefill + 5 steps)


def test_a_cancelled_request_leaves_and_the_others_are_unchanged(model):
    keep, cancel = request(model, "keep", PROMPTS[0], 12), request(model, "cancel", PROMPTS[3], 12)
    plans, requests = drive(model, {0: [keep, cancel]}, rows=2, cancels={3: ["cancel"]})
    assert requests["cancel"].finish_reason == "cancelled" and 1 <= len(requests["cancel"].generated) < 12
    assert requests["keep"].generated == greedy_ids(model, [keep.tokens], 12)[0]
    keeps = [len(plan.keep) for plan in plans if plan.keep or plan.joining]
    assert keeps[:4] == [0, 2, 2, 1] and set(keeps[3:]) == {1}  # it left at the step after the cancel


def test_each_request_keeps_its_own_sampling_and_seed(model):
    sampled = dict(temperature=0.9, top_p=0.9, top_k=50)
    alone = drive(model, {0: [request(model, "s", PROMPTS[4], 12, seed=5, **sampled)]}, rows=1)[1]["s"]
    mixed = drive(model, {0: [request(model, "g", PROMPTS[2], 12), request(model, "t", PROMPTS[1], 12, seed=9,
                                                                          temperature=1.2)],
                          2: [request(model, "s", PROMPTS[4], 12, seed=5, **sampled)]}, rows=3)[1]
    assert mixed["s"].generated == alone.generated  # same seed, other company: same tokens
    assert mixed["g"].generated == greedy_ids(model, [mixed["g"].tokens], 12)[0]


def _arrivals_at_two_ranks(folder):
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=128)
    torch.manual_seed(model.ctx.rank)  # ranks' own RNGs differ: agreement must not depend on them
    arrivals = {0: [request(model, "a", PROMPTS[2], 10, temperature=0.8)],
                3: [request(model, "b", PROMPTS[0], 10), request(model, "c", PROMPTS[3], 6, seed=1, temperature=1.0)]}
    plans, requests = drive(model, arrivals, rows=2)
    return [(p.keep, p.tokens, p.joining.prompts) for p in plans], {k: r.generated for k, r in requests.items()}


def test_ranks_run_the_same_plans_as_requests_arrive(tiny_checkpoints):
    (plans0, out0), (plans1, out1) = run_ranks(2, _arrivals_at_two_ranks, tiny_checkpoints["mha", 2])
    assert plans0 == plans1 and out1 == {}  # the followers only execute
    assert sorted(out0) == ["a", "b", "c"] and len(out0["c"]) == 6
    assert any(admit and keep for keep, _, admit in plans0)  # a later request joined a running batch


# ---- the service's queue ---------------------------------------------------------------------------------------------

def test_the_queue_is_bounded_and_closes_on_shutdown(model):
    from accessory.serve.service import GenerationService, QueueFull, ServiceClosed

    service = GenerationService(model, max_queue=2, grace_s=0)
    service.submit("Hi", {"max_gen_len": 4})
    service.submit("Hi", {"max_gen_len": 4})
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        service.submit("Hi", {"max_gen_len": 4})
    with pytest.raises(ValueError, match="max_seq_len"):
        service.submit("Hi " * 200)
    with pytest.raises(ValueError, match="top_p"):
        service.submit("Hi", {"top_p": 2.0})
    service.shutdown()
    with pytest.raises(ServiceClosed):
        service.submit("Hi", {"max_gen_len": 4})
    service.run()  # finishes (or, past the grace period, cancels) what was accepted, then returns
    assert service.running == 0


def test_http_429_when_the_queue_is_full(model):
    from fastapi.testclient import TestClient

    from accessory.serve.api import create_app
    from accessory.serve.service import GenerationService

    service = GenerationService(model, max_queue=1)
    service.submit("Hi", {"max_gen_len": 4})  # not running: it waits
    client = TestClient(create_app(service, "tiny"))
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4})
    assert answer.status_code == 429 and answer.json()["error"]["type"] == "rate_limit_error"
    service.shutdown()
    service.run()
