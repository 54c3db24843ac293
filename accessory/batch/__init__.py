"""`accessory batch`: every record of a JSONL file through the model, on a torchrun world split as data-parallel x
model-parallel, written as JSONL; resumable after any crash.

    records.py   the input: JSONL records, each line checked and named, their images read whole
    output.py    OUT, its per-group parts and the merge (what a rerun finds done); each finished row's fields
    plan.py      global rank 0's plan before any model loads, and the jobs shared out over the groups
    rendering.py a pending record rendered to the prompt the engine sees (Job), its tokens counted
    group.py     one data-parallel group's share: the generation loop, images read on its source rank
    ranks.py     work on rank 0 alone, and any rank's failure stopping every rank with one message
    summary.py   what each group reports and the summary global rank 0 prints
    job.py       the whole job on every rank: run_batch, what `accessory batch` calls
"""
from accessory.batch.job import run_batch
from accessory.batch.options import BatchOptions

__all__ = ["BatchOptions", "run_batch"]
