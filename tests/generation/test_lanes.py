"""A pipeline's lanes (micro-batches, engine.py `Lane`): the schedulers of one run's lanes share their requests
(scheduler.py `Intake`): a request waits for a row in any lane, the lanes fill evenly, a cancel reaches the lane that
holds the request, and the run is done only when every lane is. No model: the schedulers' plans are read directly."""
from __future__ import annotations

import torch

from accessory.generation.requests import Request
from accessory.generation.sampling import SamplingParams
from accessory.generation.scheduler import Scheduler


class Tokenizer:
    n_words = 100

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def lanes(rows: list[int]) -> list[Scheduler]:
    return Scheduler(Tokenizer(), {0}, sum(rows), 100, torch.device("cpu")).lanes(rows)


def request(i: int, max_gen_len: int = 4) -> Request:
    return Request(i, [1, 2, 3], SamplingParams(max_gen_len), seed=0)


def test_requests_fill_the_lanes_evenly_and_wait_for_a_row_in_any():
    first, second = lanes([4, 4])
    for i in range(5):
        first.add(request(i))
    first.close()
    plan, _ = first.step(None)
    assert plan.joining.ids == (0, 1, 2)  # its even share of 5, rounded up
    plan, _ = second.step(None)
    assert plan.joining.ids == (3, 4)
    assert not plan.done, "the other lane's rows are still running"


def test_a_lane_alone_with_work_takes_as_many_as_its_rows():
    first, second = lanes([2, 2])
    for i in range(6):
        first.add(request(i))
    first.close()
    assert first.step(None)[0].joining.ids == (0, 1)
    assert second.step(None)[0].joining.ids == (2, 3)
    assert len(first.intake.waiting) == 2 and first.intake.queued() == 2
    assert [r.id for r in first.intake.in_batch()] == [0, 1, 2, 3]


def test_a_cancel_read_by_one_lane_ends_the_request_in_another():
    first, second = lanes([1, 1])
    first.add(request("a"))
    assert first.step(None)[0].joining.ids == ("a",)
    first.cancel("a")
    plan, events = second.step(None)  # reads the inbox: "a" is in the other lane's rows
    assert [(e.id, e.finish_reason) for e in events] == [("a", "cancelled")] and plan.joining.ids == ()
    plan, events = first.step(None)
    assert plan.results[0].finish != 0 and plan.keep == () and events == []  # reported once, by the cancel


def test_the_run_is_done_when_every_lane_is():
    first, second = lanes([1, 1])
    first.close()
    assert first.step(None)[0].done and second.step(None)[0].done
