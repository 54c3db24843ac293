"""`accessory batch`: a JSONL file's records generated resumably on a torchrun world split as data-parallel x
model-parallel groups."""
from __future__ import annotations

from accessory.cli.options import (add_image_args, add_model_args, add_sampling_args, positive_int, rows_or_auto,
                                   sampling_kwargs)
from accessory.cli.process import load_model


def add_batch_verb(verbs) -> None:
    batch = verbs.add_parser("batch", help="generate for every record of a JSONL file, resumably, on a torchrun "
                             "world split as data-parallel x model-parallel")
    add_model_args(batch)
    sampling = add_sampling_args(batch)
    sampling.add_argument("--template", help="conversation template for \"messages\" records (default: the "
                          "model's own chat template)")
    job = batch.add_argument_group("batch")
    job.add_argument("--input", required=True, help="JSONL: {\"id\", \"prompt\"} or {\"id\", \"messages\"} per line, "
                     "each with an optional \"image\": \"FILE\" for a vision-language model (a relative path is "
                     "taken from the input file's folder; under torchrun every group's rank 0 reads it, so on several "
                     "machines it must be on a filesystem they share)")
    job.add_argument("--output", required=True, help="JSONL of {\"id\", \"output\", ...}; a rerun skips ids already "
                     "in it or in its OUTPUT.part-* files")
    job.add_argument("--mp", type=positive_int, default=1, help="model-parallel ranks per group; the world size "
                     "must be a multiple (data-parallel groups = world / mp)")
    job.add_argument("--batch_size", type=rows_or_auto, help="rows in flight per group (the same as "
                     "--max_batch_size, which it overrides; default 8; auto: as many as fit, see --max_batch_size)")
    job.add_argument("--country-iso-code", metavar="XXX", help="report the generation's energy (kWh) and CO2 (kg) "
                     "in the summary, estimated offline by codecarbon (the energy extra) with this country's "
                     "electricity mix, e.g. USA, FRA; nothing is sent or written")
    add_image_args(batch)
    batch.set_defaults(handler=run_batch, max_batch_size=8)


def run_batch(args) -> None:
    from pathlib import Path

    from accessory.batch import BatchOptions, run_batch as run
    from accessory.batch.energy import check_country

    args.max_batch_size = args.batch_size or args.max_batch_size
    country = check_country(args.country_iso_code) if args.country_iso_code is not None else None  # before loading
    options = BatchOptions(Path(args.input), Path(args.output), args.mp, args.max_batch_size, args.template,
                           args.max_seq_len, args.image_transform, country)
    run(options, sampling_kwargs(args), lambda group: load_model(args, group, warmup=True))
