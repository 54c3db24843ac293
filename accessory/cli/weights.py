"""The verbs on checkpoints on disk: convert, quantize, inspect, reshard, and weights (delta apply / extract,
merge-lora)."""
from __future__ import annotations

import argparse
import sys

from accessory.cli.options import byte_size, pipeline_layers, positive_int


def add_convert_verb(verbs) -> None:
    conv = verbs.add_parser("convert", help="convert a checkpoint between formats (accessory shards, Meta's "
                            "release, Hugging Face, GGUF, torch.distributed.checkpoint)")
    conv.add_argument("source", choices=["accessory", "meta", "hf", "gguf", "dcp"], help="the format of SRC")
    conv.add_argument("src", help="the checkpoint folder, or the .gguf file")
    conv.add_argument("dst", help="new output folder (must not exist)")
    conv.add_argument("--to", dest="target", choices=["accessory", "hf"], default="accessory",
                      help="output format (default: accessory shards)")
    conv.add_argument("--shards", type=positive_int, help="tensor-parallel shard count to save (default 1; "
                      "accessory output only)")
    conv.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: keep the source's")
    conv.add_argument("--max_shard_size", type=byte_size, default=5 << 30,
                      help="HF output: largest safetensors file, e.g. 5GB, 500MB (default 5GB)")
    conv.add_argument("--keep-quantized", action="store_true", help="GGUF source: keep Q8_0 / Q4_0 / Q4_1 tensors' "
                      "bits as int8 / int4 and Q4_K / Q5_K / Q6_K / Q5_0 blocks as they are (bit-exact; other types "
                      "are dequantized), for quantized loading")
    given = conv.add_argument_group("model description (accessory, meta and dcp sources)")
    given.add_argument("--llama_type", help="model type (default: meta.json's beside SRC, else llama)")
    given.add_argument("--llama_config", nargs="+", default=[], help="config files (params.json / config.json) "
                       "overriding those beside SRC")
    given.add_argument("--tokenizer_path", help="tokenizer.model / tokenizer.json (default: found beside SRC)")
    conv.set_defaults(handler=run_convert)


def run_convert(args) -> None:
    from pathlib import Path

    from accessory.checkpoint.convert import convert
    from accessory.runtime.loading import DTYPES

    convert(args.source, Path(args.src), Path(args.dst), args.shards, DTYPES[args.dtype] if args.dtype else None,
            args.target, args.llama_type, args.llama_config, args.tokenizer_path, args.max_shard_size,
            args.keep_quantized)
    print(args.dst)


def add_quantize_verb(verbs) -> None:
    quantize = verbs.add_parser("quantize", help="write a float checkpoint with weight-only int8 or int4 weights "
                                "(safetensors shards that load and reshard at any rank count)")
    quantize.add_argument("src", help="a float checkpoint folder (accessory or Meta shards, any count)")
    quantize.add_argument("dst", help="new checkpoint folder (must not exist)")
    quantize.add_argument("--to", dest="fmt", required=True, choices=["int8", "int4"],
                          help="int8: every linear and the embedding; int4: the blocks' linears (the embedding and "
                          "output in int8)")
    quantize.add_argument("--shards", type=positive_int, help="shard count to write (default: the source's)")
    quantize.set_defaults(handler=run_quantize)


def run_quantize(args) -> None:
    from pathlib import Path

    from accessory.checkpoint.quantize import quantize_checkpoint

    quantize_checkpoint(Path(args.src), Path(args.dst), args.fmt, args.shards)
    print(args.dst)


def add_inspect_verb(verbs) -> None:
    inspect = verbs.add_parser("inspect", help="describe a checkpoint (format, shards, dtype, parameters, config, "
                               "tokenizer) and check every shard; exit 1 naming the problems if any")
    inspect.add_argument("path", help="a checkpoint folder (accessory, Meta, HF, DCP) or a .gguf file")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.add_argument("--ranks", type=positive_int, help="a mixture of experts: also show which experts each of "
                         "this many ranks would hold")
    plan = inspect.add_argument_group("placement plan (before anything loads: layers, weight bytes and KV cache per "
                                      "rank)")
    plan.add_argument("--tp", type=positive_int, help="tensor-parallel ranks a stage")
    plan.add_argument("--pp", type=positive_int, help="pipeline stages")
    plan.add_argument("--pp-layers", type=pipeline_layers, metavar="even|balanced|auto|A,B,...",
                      help="the layer split, as `generate --pp-layers` takes it (auto: this machine's budget a stage)")
    plan.add_argument("--quant", choices=["int8", "int4"], help="as loading with --quant would hold a float checkpoint")
    plan.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="float dtype (default: fp32)")
    plan.add_argument("--max_seq_len", type=positive_int, default=4096, help="KV cache positions a row")
    inspect.set_defaults(handler=run_inspect)


def run_inspect(args) -> None:
    import json
    from pathlib import Path

    from accessory.checkpoint.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(Path(args.path), args.ranks)
    plan = placement_plan(report, args) if (args.tp or args.pp) and not report.problems else None
    if args.json:
        print(json.dumps({**report.to_dict(), **({"plan": plan} if plan else {})}, indent=2), flush=True)
    else:
        print(format_report(report) + (f"\n{plan}" if plan else ""), flush=True)
    if report.problems:
        sys.exit(1)


def placement_plan(report, args) -> str:
    """The stages and ranks `--tp`/`--pp` would give the inspected model (runtime/placement.py `plan_text`)."""
    from pathlib import Path

    from accessory.checkpoint.config import read_spec
    from accessory.checkpoint.direct import imported
    from accessory.runtime.loading import DTYPES
    from accessory.runtime.placement import plan_text

    config = {**report.config, "max_seq_len": args.max_seq_len}
    formats = None
    if report.quantization is not None or report.format == "gguf":  # held in its own formats, as loading would
        spec = read_spec([imported(Path(report.path))])
        formats = spec.quantization.tensors if spec.quantization is not None else None
    return plan_text(report.llama_type or "llama", config, formats, args.quant, args.tp or 1, args.pp or 1,
                     args.pp_layers, DTYPES[args.dtype], f"config of {report.path}")


def add_reshard_verb(verbs) -> None:
    reshard = verbs.add_parser("reshard", help="rewrite a checkpoint folder at another shard count (any N -> M)")
    reshard.add_argument("src", help="checkpoint folder (a delta folder stays a delta)")
    reshard.add_argument("dst", help="new checkpoint folder (must not exist)")
    reshard.add_argument("--shards", type=positive_int, required=True, help="shard count to write")
    reshard.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: keep each tensor's")
    reshard.set_defaults(handler=run_reshard)


def run_reshard(args) -> None:
    from pathlib import Path

    from accessory.checkpoint.reshard import reshard
    from accessory.runtime.loading import DTYPES

    reshard(Path(args.src), Path(args.dst), args.shards, DTYPES[args.dtype] if args.dtype else None)
    print(args.dst)


def add_weights_verb(verbs):
    """`accessory weights OPERATION`: one subcommand per operation on checkpoint weights (add more to `operations`)."""
    weights = verbs.add_parser("weights", help="operate on checkpoint weights on disk (delta apply / extract)")
    operations = weights.add_subparsers(dest="operation", required=True)
    apply = operations.add_parser("apply", help="base + delta (model-diff folder) -> a plain checkpoint")
    add_delta_args(apply, "the delta folder (consolidated.NN-of-MM.model-diff.pth shards)")
    apply.set_defaults(handler=run_weight_operate, operate_type="apply")
    extract = operations.add_parser("extract", help="fine-tuned - base -> a delta (model-diff) folder")
    add_delta_args(extract, "the fine-tuned checkpoint folder (LLaMA2-Accessory's name for it in extract mode)")
    extract.set_defaults(handler=run_weight_operate, operate_type="extract")
    merge = operations.add_parser("merge-lora", help="fold a llama_peft checkpoint's LoRA into a plain llama one, or "
                                  "a Hugging Face PEFT adapter into its base checkpoint")
    merge.add_argument("src", nargs="+", help="the llama_peft checkpoint folder, or its base folder followed by the "
                       "trainable-only folder(s), later ones overriding earlier ones; or the base checkpoint folder "
                       "followed by a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    merge.add_argument("dst", help="new plain llama checkpoint folder (must not exist)")
    merge.add_argument("--shards", type=positive_int, help="shard count to save (default: the first source's)")
    merge.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: the base weights' dtype")
    merge.set_defaults(handler=run_merge_lora)
    return operations


def add_delta_args(parser: argparse.ArgumentParser, delta_help: str) -> None:
    """LLaMA2-Accessory's tools/weight_operate.py flags, plus the output's shard count and dtype."""
    parser.add_argument("--pretrained_path", required=True, help="the base checkpoint folder")
    parser.add_argument("--delta_path", "--finetuned_path", dest="delta_path", required=True, help=delta_help)
    parser.add_argument("--output_path", required=True, help="new folder to write (must not exist)")
    parser.add_argument("--shards", type=positive_int, help="shard count of the output (default: the base's)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="dtype of the output (default: each "
                        "tensor keeps its own: the base's at apply, the fine-tuned one's at extract); sums are taken "
                        "in float32 and rounded once")


def run_weight_operate(args) -> None:
    from pathlib import Path

    from accessory.checkpoint.delta import apply_delta, extract_delta
    from accessory.runtime.loading import DTYPES

    operate = apply_delta if args.operate_type == "apply" else extract_delta
    operate(Path(args.pretrained_path), Path(args.delta_path), Path(args.output_path), args.shards,
            DTYPES[args.dtype] if args.dtype else None)
    print(args.output_path)


def run_merge_lora(args) -> None:
    from accessory.checkpoint.merge_lora import merge_lora
    from accessory.runtime.loading import DTYPES

    merge_lora(args.src, args.dst, args.shards, DTYPES[args.dtype] if args.dtype else None)
    print(args.dst)
