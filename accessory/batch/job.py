"""The whole `accessory batch` job, on every rank (run_batch, what the CLI calls): global rank 0 plans, every group
loads the model and generates its share, global rank 0 merges the output and prints the summary."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from typing import Callable

from accessory.batch.energy import EnergyMeter, job_energy
from accessory.batch.group import run_group
from accessory.batch.rendering import Job, check_room, render_jobs
from accessory.batch.options import BatchOptions
from accessory.batch.output import OutputFiles
from accessory.batch.plan import JobPlan, prepare, split_jobs
from accessory.batch.ranks import scatter_to_groups
from accessory.batch.records import Record
from accessory.batch.summary import GroupStats, format_summary
from accessory.parallel.context import ParallelContext, data_parallel_layout


def run_batch(options: BatchOptions, sampling: dict, load_model: Callable) -> None:
    """Every rank: plan on global rank 0, load the model on each model-parallel group, generate each group's share,
    merge on global rank 0 and print the summary there. `load_model(mp_group)` returns a MetaModel."""
    layout = data_parallel_layout(options.mp)
    world = ParallelContext.from_group(None)
    leader = world.rank == 0
    files = OutputFiles(options.output)
    plan = world.on_rank0(lambda: _prepare_and_mark_shared(options, sampling["max_gen_len"]))
    pending, nonce = world.broadcast_object((len(plan.pending), plan.check_nonce) if leader else None)
    try:  # each group's source must see the file rank 0 wrote: parts only one machine sees would miss the merge
        unseen = files.shared_check_error(nonce, layout.dp_rank) if layout.mp_rank == 0 else None
        world.raise_if_any_failed(unseen, quiet=True)
    finally:
        if leader:
            files.shared_check.unlink()
    stats, encode_s, energies = [GroupStats()], 0.0, None
    if pending:
        model = load_model(layout.mp_group)
        options = replace(options, batch_size=model.max_batch_size)  # "auto" is a number once the model is loaded
        jobs, encode_s = world.on_rank0(lambda: _timed(_rendered, model, plan.pending, options,
                                                       sampling["max_gen_len"])) or (None, 0.0)
        mine = scatter_to_groups(world, layout, split_jobs(jobs, layout.dp_size, sampling["max_gen_len"])
                                 if leader else None)
        meter = EnergyMeter(options.country_iso_code)
        world.barrier()  # the groups start together: the generate latency is one wall-clock span
        meter.start()
        mine_stats = run_group(model, layout, mine, options, sampling, leader)
        energy = meter.stop()
        stats = world.gather_object(mine_stats if model.ctx.is_source else None)
        energies = world.gather_object(energy)
    if leader:
        files.merge(plan.records, files.read_done({r.id for r in plan.records}))
        stats = [s for s in stats if s is not None]
        print(format_summary(options, layout, sampling, len(plan.records), len(plan.records) - pending,
                             stats, encode_s, job_energy(energies or [])), flush=True)
        exit_if_all_failed(stats)


def exit_if_all_failed(stats: list[GroupStats]) -> None:
    """A job whose every generated record failed (the model's logits NaN, say) exits 1, naming that: its output holds
    only errors. Some failed rows alone are the rows' own (each written with its error)."""
    generated, failed = sum(s.records for s in stats), sum(s.failed for s in stats)
    if generated and failed == generated:
        logging.getLogger(__name__).error("every one of the %d generated records failed; each output row holds its "
                                          "error", generated)
        sys.exit(1)


def _prepare_and_mark_shared(options: BatchOptions, max_gen_len: int) -> JobPlan:
    plan = prepare(options, max_gen_len)
    OutputFiles(options.output).mark_shared_check(plan.check_nonce)
    return plan


def _rendered(model, records: list[Record], options: BatchOptions, max_gen_len: int) -> list[Job]:
    jobs = render_jobs(model.tokenizer, records, options.template, model.encode_prompt)
    check_room(jobs, max_gen_len, options.max_seq_len)
    return jobs


def _timed(fn: Callable, *args):
    started = time.perf_counter()
    return fn(*args), time.perf_counter() - started
