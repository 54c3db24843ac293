"""`accessory` command line: one verb per job; each verb's handler is imported only when it runs.

    accessory generate [--pretrained_path DIR ...] --prompt TEXT [--chat] ...   (alone or under torchrun)
    accessory chat [--pretrained_path DIR ...] [--template NAME] [--system TEXT] ...
    accessory serve [--pretrained_path DIR ...] [--host H] [--port P] [--api-key KEY] ...   (OpenAI-compatible)
    accessory batch --input IN.jsonl --output OUT.jsonl [--mp N] [--batch_size N] ...   (dp x mp under torchrun)
    accessory compile [--pretrained_path DIR ...] [--quant int4] ...   (the CPU decode step, once for later --compile)
    accessory convert {accessory,meta,hf,gguf,dcp} SRC DST [--to {accessory,hf}] [--shards N] ...
    accessory quantize SRC DST --to {int8,int4} [--shards N]
    accessory inspect PATH [--json]
    accessory weights {apply,extract} --pretrained_path BASE --delta_path DELTA --output_path OUT [--shards N]
    accessory weights merge-lora SRC [SRC ...] DST [--shards N]
    accessory reshard SRC DST --shards N
    accessory export onnx SRC OUT_DIR [--opset N]   (float32, the KV cache as inputs and outputs)
    accessory cache {ls,rm} [NAME ...] [--kind K] [--older-than DAYS] [--all]   (imports, compiled steps, kernels)

One module per verb (or family of verbs); options.py holds the shared arguments, process.py how every entry
point runs on a rank."""
from __future__ import annotations

import argparse

from accessory import __version__
from accessory.cli.batch import add_batch_verb
from accessory.cli.cache import add_cache_verb
from accessory.cli.chat import add_chat_verb
from accessory.cli.compile import add_compile_verb
from accessory.cli.export import add_export_verb
from accessory.cli.generate import add_generate_verb
from accessory.cli.options import add_log_level, add_model_args, add_sampling_args, both_spellings, positive_int
from accessory.cli.process import load_model, run
from accessory.cli.serve import add_serve_verb
from accessory.cli.weights import (add_convert_verb, add_delta_args, add_inspect_verb, add_quantize_verb,
                                   add_reshard_verb, add_weights_verb, run_weight_operate)
from accessory.config_file import parse_args

__all__ = ["main", "build_parser", "run", "load_model", "add_model_args", "add_sampling_args", "both_spellings",
           "positive_int", "add_delta_args", "run_weight_operate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accessory", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"accessory {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_generate_verb(verbs)
    add_chat_verb(verbs)
    add_batch_verb(verbs)
    add_serve_verb(verbs)
    add_compile_verb(verbs)
    add_convert_verb(verbs)
    add_quantize_verb(verbs)
    add_inspect_verb(verbs)
    add_weights_verb(verbs)
    add_reshard_verb(verbs)
    add_export_verb(verbs)
    add_cache_verb(verbs)
    add_log_level(parser)
    both_spellings(parser)
    return parser


def main(argv=None) -> None:
    args = parse_args(build_parser(), argv)
    run(args.handler, args)
