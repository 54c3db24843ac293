"""`accessory export onnx CKPT OUT_DIR`: a checkpoint as an ONNX model for onnxruntime and other ONNX runtimes (the
`onnx` extra): one process's whole model in float32, its KV cache as inputs and outputs (checkpoint/onnx_export.py)."""
from __future__ import annotations

import os

from accessory.cli.options import positive_int
from accessory.errors import ConfigError


def add_export_verb(verbs) -> None:
    export = verbs.add_parser("export", help="write a checkpoint in another runtime's format (onnx)")
    formats = export.add_subparsers(dest="format", required=True)
    onnx = formats.add_parser("onnx", help="the model in float32 as OUT_DIR/model.onnx (dynamic batch and sequence, "
                              "past_key_values in, present out), with onnx.json and the tokenizer files; "
                              "quantized weights (a GGUF's kept bits) are dequantized")
    onnx.add_argument("src", help="a checkpoint folder, a .gguf file or an HF folder (what --pretrained_path takes)")
    onnx.add_argument("dst", help="new output folder (must not exist)")
    onnx.add_argument("--quant", choices=["none"], default="none", help="the exported weights' format: none "
                      "(float32; ONNX runtimes run it everywhere)")
    onnx.add_argument("--opset", type=positive_int, help="ONNX opset version (default: torch's exporter's)")
    onnx.add_argument("--max_seq_len", type=positive_int, default=4096, help="positions the exported model covers "
                      "(past + sequence)")
    onnx.add_argument("--llama_type", help="model type (default: meta.json's beside SRC, else llama)")
    onnx.add_argument("--llama_config", nargs="+", default=[], help="config files overriding those beside SRC")
    onnx.add_argument("--tokenizer_path", help="tokenizer.model / tokenizer.json (default: found beside SRC)")
    onnx.set_defaults(handler=run_export_onnx)


def run_export_onnx(args) -> None:
    from pathlib import Path

    from accessory.checkpoint.onnx_export import export_onnx
    from accessory.checkpoint.save import check_new_folder
    from accessory.model.meta import MetaModel

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("accessory export onnx writes one process's whole model: run it without torchrun")
    check_new_folder(args.dst)  # before the model loads
    model = MetaModel.from_pretrained(args.src, llama_type=args.llama_type, llama_config=args.llama_config,
                                      tokenizer_path=args.tokenizer_path, max_seq_len=args.max_seq_len,
                                      dtype="fp32", device="cpu", max_batch_size=1, prefix_cache=False)
    export_onnx(model.llma, model.tokenizer.files, Path(args.dst), args.opset)
    print(args.dst, flush=True)
