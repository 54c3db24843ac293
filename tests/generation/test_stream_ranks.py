"""Ranks that disagree: a loop that breaks out of the stream on one rank only ends with RanksDisagree on every rank
within the rank timeout, never a hang. (That the loop breaking on every rank ends alike everywhere, at 1 and 3 ranks,
twice in a row, is tests/model/test_seed_examples.py, on LLaMA2-Accessory's own example.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port
from conftest import TESTS

CONV_SEP = "."
QUESTION = "Tell me about the moon."
TIMEOUT_S = 5


def seed_loop(model, conv_sep: str = CONV_SEP, stop_after=None) -> tuple[str, int]:
    """The seed document's loop (with a chunk count beside it); `stop_after`: this rank breaks after that many
    chunks whatever the text says (a deliberately disagreeing rank)."""
    from accessory.data.conversation import default_conversation

    conv = default_conversation()
    conv.append_message(conv.roles[0], QUESTION)
    conv.append_message(conv.roles[1], None)
    chunks, response = 0, ""
    for response_in_progress in model.stream_generate(conv.get_prompt(), image=None, max_gen_len=64):
        chunks += 1
        sep_pos = response_in_progress["text"].find(conv_sep)
        if sep_pos != -1 or chunks == stop_after:
            response = response_in_progress["text"][:sep_pos]
            break
        response = response_in_progress["text"]
    return response, chunks


DISAGREEING_SCRIPT = """
import logging, os, sys, time
sys.path[:0] = {paths!r}
rank = int(os.environ["RANK"])
logging.basicConfig(format=f"[rank {{rank}}] %(message)s", level=logging.WARNING)
from accessory.errors import RanksDisagree
from accessory.model.meta import MetaModel
from test_stream_ranks import QUESTION, seed_loop

model = MetaModel.from_pretrained({folder!r}, max_seq_len=512, rank_timeout={timeout})
start = time.monotonic()
try:
    seed_loop(model, conv_sep="\\0", stop_after=3 if rank == 0 else None)
    print(f"[rank {{rank}}] left the loop", flush=True)
    model.generate([QUESTION], max_gen_len=4)  # the next call the rank that broke out goes on to
except RanksDisagree as e:
    print(f"[rank {{rank}}] raised RanksDisagree after {{time.monotonic() - start:.1f}} s: {{e}}", flush=True)
    time.sleep(3)  # a script that goes on a moment: the watchdogs end the ranks that cannot raise
    sys.exit(1)
print(f"[rank {{rank}}] no error", flush=True)
"""


@pytest.mark.alone  # the ranks must answer within TIMEOUT_S
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_break_on_one_rank_only_ends_every_rank_with_a_named_error(smollm2_checkpoint, tmp_path, transport):
    """Under torchrun, rank 0 leaves the stream after 3 chunks and goes on to its next call; ranks 1 and 2 go on
    reading. Ranks 1 and 2 raise RanksDisagree at once, naming where they are: through shared memory, rank 0's next
    collective is not theirs; across machines (links.py), rank 0's next message is its next call's broadcast where
    they wait for the step's sum. Rank 0 raises too, or, blocked in a collective that the others never join, is
    ended by its watchdog with their message."""
    script = tmp_path / "disagree.py"
    script.write_text(DISAGREEING_SCRIPT.format(paths=[str(TESTS), str(Path(__file__).parent)],
                                                folder=str(smollm2_checkpoint), timeout=TIMEOUT_S))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(
        os.environ, OMP_NUM_THREADS="1", ACCESSORY_TRANSPORT=transport))
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "no error" not in out, out[-4000:]
    assert "[rank 0] left the loop" in out, out[-4000:]
    cause = r"not (at the same generation step|in the same collective)"
    for rank in range(3):  # each raised, or (blocked in a collective) was ended by its watchdog, naming the cause
        raised = re.search(rf"\[rank {rank}\] raised RanksDisagree after ([0-9.]+) s: .*{cause}", out)
        ended = re.search(rf"\[rank {rank}\] rank \d failed: .*{cause}", out)
        assert (raised and float(raised.group(1)) < TIMEOUT_S + 10) or ended, out[-4000:]
    where = (r"rank [12] is at generation call 1, step \d, but .* not in the same collective: rank [12] is in an "
             r"all-reduce of \d+ int64, rank 0 in a broadcast" if transport == "shm" else
             r"rank [12] is at generation call 1, step \d, but rank 0 sent a broadcast of \d+ bytes where this rank "
             r"waited for a sum")
    # Across machines rank 0 may see it first: its next call's sum takes the others' shares of their step's sum,
    # whose places name where each rank is (and its announcement reaches them before they read its broadcast).
    seen_by_rank_0 = r"rank 0 is at generation call 2, step 0, but rank 1 at generation call 1, step \d"
    assert re.search(where, out) or (transport == "gloo" and re.search(seen_by_rank_0, out)), out[-4000:]
