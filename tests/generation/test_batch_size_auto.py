"""`max_batch_size="auto"` (generation/batch_size.py) against the memory really available: a process whose data
segment may grow by only BUDGET bytes past what the loaded model uses (RLIMIT_DATA: the kernel refuses the rest, as
a full machine would), told the same budget through ACCESSORY_MEMORY_BUDGET. The oracle is bisection in that process:
the most rows a real run at max_seq_len (prefill, then decode steps) gets through, each try in a fork of it. auto's pick is within 10% of it,
below it. Told 4x the budget, auto's arithmetic asks for too many rows, allocating them fails, and it halves until
the allocation succeeds (logged), instead of crashing."""
from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

MAX_SEQ_LEN = 4096  # the tiny MHA model's KV cache: 6 MiB a row at 4096 positions in float32 (its logits: 125 KiB)
BUDGET = 256 << 20
HERE = Path(__file__).parent
# glibc's malloc with a fixed mmap threshold: every block of 128 KiB or more is mapped when allocated and unmapped
# when freed, so the data segment is what is live (by default the threshold rises after a large block is freed, and
# the heap then keeps freed memory: how much a later run may allocate would depend on the runs before it)
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": "0"}


def data_bytes() -> int:
    """This process's data segment (VmData: what RLIMIT_DATA limits)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmData in /proc/self/status")


def runs(model, rows: int) -> bool:
    """Whether `rows` requests at max_seq_len run together: prefill and two decode steps, every row in the batch."""
    from accessory.generation.requests import Request
    from accessory.generation.sampling import SamplingParams

    engine = model.engine.configured(max_batch_size=rows)
    requests = [Request(i, [1, 100 + i, 200 + i], SamplingParams(max_gen_len=MAX_SEQ_LEN - 3), 0)
                for i in range(rows)]
    stream = engine.stream(requests)
    try:
        for step, _ in enumerate(stream):
            if step == 3:
                return True
    except (RuntimeError, MemoryError):
        return False
    finally:
        stream.close()  # its caches go with `engine`
    raise AssertionError("the run ended before its third step")


def runs_alone(model, rows: int) -> bool:
    """`runs` in a fork of this process: every try starts from the same memory, whatever the tries before it left."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = 0 if runs(model, rows) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the try at {rows} rows failed otherwise (exit status {code})"
    return code == 0


def largest_that_runs(model, high: int) -> int:
    """Bisection over rows: 1 runs, `high` does not."""
    low = 1
    assert runs_alone(model, low)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if runs_alone(model, middle) else (low, middle)
    return low


def child(folder: str, told: int) -> None:
    """In a process of its own: load, limit the data segment to BUDGET more, then auto's pick (told `told` bytes)
    and the bisection's."""
    from accessory.generation.batch_size import auto_batch_size
    from accessory.network.memory import BUDGET_ENV
    from accessory.model.meta import MetaModel
    from accessory.network.kv_caches import KVCaches

    logging.basicConfig(level=logging.INFO)  # auto's arithmetic, on stderr
    model = MetaModel.from_pretrained(folder, max_seq_len=MAX_SEQ_LEN, dtype="fp32", device="cpu",
                                      max_batch_size=1, prefix_cache=False)
    assert runs(model, 2)  # whatever a first run allocates once (kernels, lazy imports) is in the baseline
    resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + BUDGET, resource.RLIM_INFINITY))
    os.environ[BUDGET_ENV] = str(told)
    picked = auto_batch_size(model.llma, reserved=0)
    fits = largest_that_runs(model, high=BUDGET // KVCaches.row_nbytes(model.llma, MAX_SEQ_LEN) + 1)
    print(json.dumps({"picked": picked, "fits": fits}), flush=True)


def run_child(folder: Path, told: int) -> tuple[dict, str]:
    code = f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; import test_batch_size_auto as t; " \
           f"t.child({str(folder)!r}, {told})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **STEADY_MALLOC))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def folder(tiny_checkpoints):
    return tiny_checkpoints["mha", 1]


def test_auto_picks_within_10_percent_of_the_largest_batch_that_runs(folder):
    result, log = run_child(folder, BUDGET)
    assert 0.9 * result["fits"] <= result["picked"] <= result["fits"], result
    assert "max_batch_size auto: ACCESSORY_MEMORY_BUDGET 256.00 MiB, less 5% margin" in log, log  # the arithmetic, logged
    assert "trying" not in log


def test_auto_backs_off_when_the_allocation_fails(folder):
    """Told 4x what the process may allocate: the KV cache and workspace of auto's first pick cannot be allocated;
    halved until they can, the pick runs."""
    result, log = run_child(folder, 4 * BUDGET)
    assert "allocating" in log and "trying" in log, log
    assert result["fits"] // 4 <= result["picked"] <= result["fits"], result


def test_the_command_line_takes_auto():
    from accessory.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-batch-size", "auto"])
    assert args.max_batch_size == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--max-batch-size", "many"])
