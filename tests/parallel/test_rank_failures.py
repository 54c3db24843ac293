"""One rank's error stops every rank (ParallelContext.raise_if_any_failed, on_rank0): the failing rank raises its own
error, the others one naming it (even when its message is empty), or with `quiet` exit 2 without a word."""
from __future__ import annotations

from distributed import run_ranks


def outcome(call) -> str:
    try:
        call()
    except SystemExit as e:
        return f"exit {e.code}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "went on"


def each_way_of_failing() -> list[str]:
    from accessory.parallel import ParallelContext
    ctx = ParallelContext.from_group()
    mine = lambda message: ValueError(message) if ctx.rank == 1 else None  # noqa: E731

    def fail_on_rank0():
        raise KeyError("no such prompt")

    return [outcome(lambda: ctx.raise_if_any_failed(None)),
            outcome(lambda: ctx.raise_if_any_failed(mine("bad value"))),
            outcome(lambda: ctx.raise_if_any_failed(mine(""))),
            outcome(lambda: ctx.raise_if_any_failed(mine("bad value"), quiet=True)),
            outcome(lambda: ctx.on_rank0(lambda: 7)),
            outcome(lambda: ctx.on_rank0(fail_on_rank0))]


def test_one_ranks_error_stops_every_rank_and_the_others_name_it():
    rank0, rank1 = run_ranks(2, each_way_of_failing)
    assert rank0 == ["went on", "RuntimeError: model-parallel rank 1 failed: ValueError: bad value",
                     "RuntimeError: model-parallel rank 1 failed: ValueError: ", "exit 2", "went on",
                     "KeyError: 'no such prompt'"]
    assert rank1 == ["went on", "ValueError: bad value", "ValueError: ", "ValueError: bad value", "went on", "exit 2"]
