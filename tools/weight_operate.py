"""LLaMA2-Accessory's tools/weight_operate.py, with its flags: apply a delta to a base, or extract one.

    python tools/weight_operate.py --pretrained_path BASE --delta_path DELTA --output_path OUT --operate_type apply
    python tools/weight_operate.py --pretrained_path BASE --delta_path FINETUNED --output_path DELTA \\
        --operate_type extract [--shards N] [--dtype fp32]

The same as `accessory weights apply|extract` (docs/weights.md).
"""
import argparse

from accessory.cli import add_delta_args, run, run_weight_operate


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_delta_args(parser, "apply: the delta folder; extract: the fine-tuned checkpoint folder")
    parser.add_argument("--operate_type", default="apply", choices=["extract", "apply"])
    run(run_weight_operate, parser.parse_args(argv))


if __name__ == "__main__":
    main()
