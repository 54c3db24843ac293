"""`accessory batch`: JSONL records through the model on data-parallel x model-parallel ranks, flushed per record,
resumable. The oracle is the same weights at one rank, each prompt generated alone; the real model must answer
"Paris". Bad input is refused by line number before any model loads."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import free_port

MAX_GEN_LEN = 24
TINY_SEQ_LEN = "256"


def batch_command(args: list[str], nproc: int | None = None, torchrun: list[str] | None = None) -> list[str]:
    """`accessory batch ...` alone, or under torchrun with `--nproc-per-node=nproc` (and `torchrun` flags)."""
    if nproc is None:
        return [sys.executable, "-m", "accessory", "batch", *args]
    rendezvous = torchrun or ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *rendezvous,
            "-m", "accessory", "batch", *args]


def run(command: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def tiny_records(n: int) -> list[dict]:
    """Plain prompts of several lengths, and every fifth record a conversation (rendered with Accessory's default
    template, whose stop string "###" then applies to it alone)."""
    records = []
    for i in range(n):
        if i % 5 == 4:
            records.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"Tell me about number {i}."}]})
        else:
            records.append({"id": i if i % 3 == 0 else f"r{i}",  # integer ids too
                            "prompt": f"The story of record {i} " + "goes on " * (i % 7)})
    return records


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def oracle_outputs(folder: Path, records: list[dict], max_gen_len: int) -> dict:
    """id -> the single-process greedy answer, each record generated alone."""
    from accessory.generation.chat import render_chat
    from accessory.model.meta import MetaModel

    model = MetaModel.from_pretrained(folder, max_seq_len=int(TINY_SEQ_LEN))
    answers, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's small ops run ~10x slower on two threads of a two-core machine
    try:
        for record in records:
            prompt, stops = record.get("prompt"), []
            if "messages" in record:
                prompt, stops = render_chat(model.tokenizer, record["messages"], None)
            [answers[record["id"]]] = model.generate([prompt], max_gen_len=max_gen_len,
                                                     additional_stop_symbols=stops)
    finally:
        torch.set_num_threads(threads)
    return answers


def options_for(tmp_path, records):
    from accessory.batch import BatchOptions

    return BatchOptions(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl", max_seq_len=256)


SAMPLING = dict(max_gen_len=8, temperature=0.0, top_p=0.95, top_k=0, repetition_penalty=1.0, seed=None)


def no_model(group):
    raise AssertionError("a model was loaded where none should be")


def row(record_id, text="x"):
    return {"id": record_id, "output": text, "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 1,
            "prompt_truncated": False}


@pytest.fixture(scope="module")
def fifty(tiny_checkpoints):
    records = tiny_records(50)
    return records, oracle_outputs(tiny_checkpoints["mha", 1], records, MAX_GEN_LEN)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (torchrun starts each worker in a session of its own, so killing torchrun's
    process group would leave the workers running)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def crash(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once, as a machine failure would (stopped first, so none reacts)."""
    tree = process_tree(proc.pid)
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def lines_in_parts(output: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in output.parent.glob(output.name + ".part-*"))


def test_killed_midway_then_rerun_gives_every_record_once_equal_to_one_process(tiny_checkpoints, fifty, tmp_path):
    """2 data-parallel x 2 model-parallel ranks, SIGKILLed once some records are written (and a torn line left as
    a kill mid-write would), then rerun: 50 outputs in input order, each exactly once, each the one-rank greedy
    answer; the records written before the crash are not generated again; the input is untouched."""
    records, oracle = fifty
    source = write_jsonl(tmp_path / "in.jsonl", records)
    before = source.read_bytes()
    output = tmp_path / "out" / "answers.jsonl"
    args = ["--pretrained_path", str(tiny_checkpoints["mha", 2]), "--input", str(source), "--output", str(output),
            "--mp", "2", "--batch_size", "4", "--max_gen_len", str(MAX_GEN_LEN), "--max_seq_len", TINY_SEQ_LEN]
    first = subprocess.Popen(batch_command(args, nproc=4), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 240
    while lines_in_parts(output) < 6 and first.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    crash(first)
    written = lines_in_parts(output)
    assert 6 <= written < 50, f"killed with {written} records written: {first.stderr.read().decode()[-3000:]}"
    assert not output.exists()
    with open(output.with_name(output.name + ".part-1"), "ab") as part:
        part.write(b'{"id": "r3", "output": "torn mid-wri')  # a kill during a write leaves this

    rerun = run(batch_command(args, nproc=4))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = read_jsonl(output)
    assert [row["id"] for row in rows] == [r["id"] for r in records]
    assert {row["id"]: row["output"] for row in rows} == oracle
    assert f"50 ({50 - written} generated, 0 failed, {written} already done)" in rerun.stdout
    assert "dropping an unfinished last line" in rerun.stderr
    assert sorted(p.name for p in output.parent.iterdir()) == ["answers.jsonl"]  # parts merged and removed
    assert source.read_bytes() == before
    assert all(row["prompt_tokens"] > 0 and not row["prompt_truncated"] for row in rows)
    assert all(row["output_tokens"] == MAX_GEN_LEN if row["finish_reason"] == "length" else
               row["finish_reason"] == "stop" and row["output_tokens"] < MAX_GEN_LEN for row in rows)


def test_default_model_answers_messages_at_one_by_three(smollm2_checkpoint, tmp_path):
    """The built-in SmolLM2 (no --pretrained_path; the fixture imports it first, as the CLI would), one
    model-parallel group of 3 ranks, chat records rendered with its own template and stopped at its end-of-turn
    token."""
    records = [{"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
               {"id": "italy", "messages": [{"role": "system", "content": "Answer in one short sentence."},
                                            {"role": "user", "content": "What is the capital of Italy?"}]},
               {"id": "japan", "messages": [{"role": "user", "content": "What is the capital of Japan?"}]}]
    output = tmp_path / "answers.jsonl"
    result = run(batch_command(["--input", str(write_jsonl(tmp_path / "in.jsonl", records)), "--output", str(output),
                                "--mp", "3", "--max_gen_len", "32"], nproc=3))
    assert result.returncode == 0, result.stderr[-3000:]
    answers = {row["id"]: row["output"] for row in read_jsonl(output)}
    assert list(answers) == ["france", "italy", "japan"]
    assert "Paris" in answers["france"] and "Rome" in answers["italy"] and "Tokyo" in answers["japan"], answers
    assert not any("<|im_end|>" in a for a in answers.values())
    assert "1 data-parallel x 3 model-parallel" in result.stdout and "3 (3 generated, 0 failed, 0 already done)" in result.stdout


# ---- bad input: named, before any model loads ---------------------------------------------------------------------

GOOD = '{"id": "ok", "prompt": "hello"}'


@pytest.mark.parametrize("line, message", [
    ("{not json", ":2: not JSON (Expecting property name"),
    ('["id", "prompt"]', ":2: a JSON array; expected one JSON object per line"),
    ('{"prompt": "hi"}', ':2: no "id"'),
    ('{"id": 1.5, "prompt": "hi"}', ':2: "id" must be a string or an integer, got 1.5'),
    ('{"id": true, "prompt": "hi"}', ':2: "id" must be a string or an integer, got true'),
    ('{"id": "x"}', ":2: record 'x' has neither \"prompt\" nor \"messages\"; expected exactly one"),
    ('{"id": "x", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
     ':2: record \'x\' has both "prompt" and "messages"; expected exactly one'),
    ('{"id": "x", "prompt": ["hi"]}', ':2: "prompt" of record \'x\' must be a string, got a JSON array'),
    ('{"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "hi"}]}',
     ":2: \"messages\" of record 'x': the last message must be the user's"),
    ('{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}', "messages[0] must be {'role': one of"),
    ('{"id": "x", "prompt": "hi", "max_tokens": 3}', ":2: unknown key(s) ['max_tokens']"),
    ('{"id": "ok", "prompt": "again"}', ":2: duplicate id 'ok' (first on line 1)"),
], ids=["not-json", "array", "no-id", "float-id", "bool-id", "neither", "both", "prompt-not-string",
        "messages-end-with-system", "unknown-role", "unknown-key", "duplicate-id"])
def test_bad_line_is_named(tmp_path, line, message):
    from accessory.batch.errors import BatchInputError
    from accessory.batch.records import read_records

    path = tmp_path / "in.jsonl"
    path.write_text(f"{GOOD}\n{line}\n")
    with pytest.raises(BatchInputError) as error:
        read_records(path)
    assert str(error.value).startswith(f"{path}:2: ")
    assert message in str(error.value)


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    from accessory.batch.records import read_records

    path = tmp_path / "in.jsonl"
    path.write_text(f"{GOOD}\n\n   \n" + '{"id": 7, "messages": [{"role": "user", "content": "hi"}]}\n\n')
    assert [(r.line, r.id) for r in read_records(path)] == [(1, "ok"), (4, 7)]


def test_bad_input_under_torchrun_stops_every_rank_with_one_message(tiny_checkpoints, tmp_path):
    """Rank 0 reads the input; the other rank hears of the error and exits 2 quietly, before loading."""
    source = tmp_path / "in.jsonl"
    source.write_text(f"{GOOD}\n{GOOD}\n")
    output = tmp_path / "out.jsonl"
    result = run(batch_command(["--pretrained_path", str(tiny_checkpoints["mha", 1]), "--input", str(source),
                                "--output", str(output)], nproc=2))
    assert result.returncode != 0
    assert result.stderr.count(f"{source}:2: duplicate id 'ok' (first on line 1)") == 1, result.stderr[-3000:]
    assert "accessory/" not in result.stderr, "no rank's traceback (torchrun reports the exit status itself)"
    assert "loading weights" not in result.stderr
    assert not list(tmp_path.glob("out.jsonl*"))


def test_bad_options_exit_2_before_loading(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "hi"}])
    result = run(batch_command(["--pretrained_path", str(tiny_checkpoints["mha", 1]), "--input", str(source),
                                "--output", str(tmp_path / "out.jsonl"), "--mp", "2"]))
    assert result.returncode == 2
    assert "model-parallel size 2 must divide the world size 1" in result.stderr
    assert "loading weights" not in result.stderr


@pytest.mark.parametrize("change, message", [
    (dict(template="nope"), "--template: unknown conversation template 'nope'; known: default"),
    (dict(max_seq_len=8), "--max_gen_len (8) must be below --max_seq_len (8)"),
    (dict(input=Path("missing.jsonl")), "--input missing.jsonl: no such file"),
])
def test_bad_options_are_refused_before_loading(tmp_path, change, message):
    import dataclasses

    from accessory.batch import run_batch
    from accessory.batch.errors import BatchInputError

    options = dataclasses.replace(options_for(tmp_path, [{"id": 1, "prompt": "hi"}]), **change)
    with pytest.raises(BatchInputError) as error:
        run_batch(options, SAMPLING, no_model)
    assert message in str(error.value)


# ---- output files, in process --------------------------------------------------------------------------------------

def test_rerun_with_every_record_done_merges_without_loading_a_model(tmp_path, capsys):
    """Done records come from the output and from any part (a crash after the merge's rename but before the parts
    were removed leaves a record in both: the first copy wins, and it is written once)."""
    from accessory.batch import run_batch

    options = options_for(tmp_path, [{"id": i, "prompt": "p"} for i in range(4)])
    write_jsonl(options.output, [row(0, "zero"), row(2, "two")])
    write_jsonl(tmp_path / "out.jsonl.part-0", [row(3, "three"), row(0, "stale zero")])
    write_jsonl(tmp_path / "out.jsonl.part-5", [row(1, "one")])
    run_batch(options, SAMPLING, no_model)
    assert read_jsonl(options.output) == [row(0, "zero"), row(1, "one"), row(2, "two"), row(3, "three")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    assert "4 (0 generated, 0 failed, 4 already done)" in capsys.readouterr().out


def test_torn_last_line_of_a_part_is_cut_before_appending(tmp_path):
    from accessory.batch.output import OutputFiles, PartWriter

    files = OutputFiles(tmp_path / "out.jsonl")
    files.part(0).write_bytes(json.dumps(row("a")).encode() + b'\n{"id": "b", "outp')
    assert list(files.read_done({"a", "b"})) == ["a"]
    writer = PartWriter(files.part(0))
    writer.write(row("b"))
    writer.close()
    assert read_jsonl(files.part(0)) == [row("a"), row("b")]


def test_output_of_another_job_is_refused(tmp_path):
    from accessory.batch import run_batch
    from accessory.batch.errors import BatchInputError

    options = options_for(tmp_path, [{"id": "a", "prompt": "p"}])
    write_jsonl(options.output, [row("a"), row("zzz")])
    with pytest.raises(BatchInputError, match=r"out.jsonl:2: id 'zzz' is not in the input; this file belongs to "
                                              r"another job"):
        run_batch(options, SAMPLING, no_model)


def test_a_broken_complete_line_is_an_error_not_skipped(tmp_path):
    from accessory.batch import run_batch
    from accessory.batch.errors import BatchInputError

    options = options_for(tmp_path, [{"id": "a", "prompt": "p"}])
    (tmp_path / "out.jsonl.part-0").write_text('{"id": "a"}\n')
    with pytest.raises(BatchInputError, match=r"out.jsonl.part-0:1: not an output row"):
        run_batch(options, SAMPLING, no_model)


def test_the_input_is_never_the_output(tmp_path):
    from accessory.batch import BatchOptions, run_batch
    from accessory.batch.errors import BatchInputError

    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "p"}])
    with pytest.raises(BatchInputError, match="is the input: the input is never overwritten"):
        run_batch(BatchOptions(source, tmp_path / "." / "in.jsonl"), SAMPLING, no_model)
    assert read_jsonl(source) == [{"id": "a", "prompt": "p"}]


class FakeModel:
    """Streams scripted events: row k ends at step `ends[k]`. Checks what the part holds at each step."""

    def __init__(self, ends: list[int], part: Path):
        self.ends, self.part, self.seen = ends, part, []

    def stream_generate(self, prompts, additional_stop_symbols=(), **sampling):
        from accessory.generation.requests import Event

        for step in range(max(self.ends) + 1):
            self.seen.append(len(read_jsonl(self.part)) if self.part.exists() else 0)
            yield [Event(k, f"{p}!", "", step >= end) for k, (p, end) in enumerate(zip(prompts, self.ends))]


def test_each_record_is_flushed_the_step_it_ends():
    """A record that ends early is on disk while the others are still generating."""
    import tempfile

    from accessory.batch.group import generate_jobs
    from accessory.batch.output import OutputFiles, PartWriter
    from accessory.batch.rendering import Job

    with tempfile.TemporaryDirectory() as folder:
        part = OutputFiles(Path(folder, "out.jsonl")).part(0)
        model = FakeModel([2, 0, 1], part)
        writer = PartWriter(part)
        jobs = [Job(i + 1, f"j{i}", f"p{i}", (), 1) for i in range(3)]
        generate_jobs(model, jobs, SAMPLING, 8, lambda job, event: writer.write(row(job.id, event.text)))
        writer.close()
        assert model.seen == [0, 1, 2]  # before step 1, row 1 (ended at step 0) is already in the part
        assert [r["id"] for r in read_jsonl(part)] == ["j1", "j2", "j0"]


def test_jobs_split_balanced_and_in_input_order():
    from accessory.batch.plan import split_jobs
    from accessory.batch.rendering import Job

    jobs = [Job(i, i, "p", (), tokens) for i, tokens in enumerate([50, 1, 1, 1, 1, 40, 3, 2, 9, 9, 30])]
    groups = split_jobs(jobs, 3, max_gen_len=10)
    assert sorted(j.id for g in groups for j in g) == list(range(len(jobs)))
    for group in groups:
        assert [j.line for j in group] == sorted(j.line for j in group)
    work = [sum(j.prompt_tokens + 10 for j in g) for g in groups]
    assert max(work) - min(work) <= 60 + 1  # within one job's work of each other
    assert split_jobs(jobs[:1], 3, 10)[1:] == [[], []]  # more groups than jobs: some have none


@pytest.mark.parametrize("template", [None, "vicuna_v1_1"])
def test_jobs_render_messages_with_the_template_and_count_prompt_tokens(llama_tokenizer, template, caplog):
    """--template names the conversation for every "messages" record (its stop strings go with them alone); a
    model without a chat template falls back to Accessory's default conversation, and says so once."""
    import logging

    from accessory.batch.records import Record
    from accessory.batch.rendering import render_jobs
    from accessory.data.conversation import get_conversation
    from accessory.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(llama_tokenizer)
    records = [Record(1, "a", prompt="Once upon a time"), Record(2, "b", messages=[{"role": "user", "content": "Hi"}]),
               Record(3, "c", messages=[{"role": "user", "content": "Bye"}])]
    with caplog.at_level(logging.INFO, logger="accessory.batch"):
        jobs = render_jobs(tokenizer, records, template)
    conv = get_conversation(template or "default")
    conv.append_message(conv.roles[0], "Hi")
    conv.append_message(conv.roles[1], None)
    assert (jobs[0].prompt, jobs[0].stops) == ("Once upon a time", ())
    assert (jobs[1].prompt, jobs[1].stops) == (conv.get_prompt(), tuple(conv.stop_symbols))
    assert ("USER: Hi" in jobs[1].prompt) == (template == "vicuna_v1_1")  # not the default by another name
    assert [j.prompt_tokens for j in jobs] == [len(tokenizer.encode(j.prompt, bos=True, eos=False)) for j in jobs]
    assert caplog.text.count("has no chat template") == (template is None)


def test_a_job_whose_every_record_failed_exits_1_and_counts_them(caplog):
    """The summary counts failed records; a job exits 1 only when every record it generated failed (some failed
    rows are their own, each written with its error), and 0 when it generated nothing."""
    from accessory.batch.job import exit_if_all_failed
    from accessory.batch.summary import GroupStats

    exit_if_all_failed([GroupStats(records=3, failed=2), GroupStats(records=0)])
    exit_if_all_failed([GroupStats()])
    with pytest.raises(SystemExit) as ended:
        exit_if_all_failed([GroupStats(records=3, failed=3), GroupStats(records=2, failed=2)])
    assert ended.value.code == 1 and "every one of the 5 generated records failed" in caplog.text
