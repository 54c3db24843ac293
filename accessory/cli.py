"""`accessory` command line: one verb per job; each verb's handler is imported only when it runs.

    accessory generate [--pretrained_path DIR ...] --prompt TEXT [--chat] ...   (alone or under torchrun)
    accessory chat [--pretrained_path DIR ...] [--template NAME] [--system TEXT] ...
    accessory serve [--pretrained_path DIR ...] [--host H] [--port P] [--api-key KEY] ...   (OpenAI-compatible)
    accessory batch --input IN.jsonl --output OUT.jsonl [--mp N] [--batch_size N] ...   (dp x mp under torchrun)
    accessory convert {accessory,meta,hf,gguf,dcp} SRC DST [--to {accessory,hf}] [--shards N] ...
    accessory quantize SRC DST --to {int8,int4} [--shards N]
    accessory inspect PATH [--json]
    accessory weights {apply,extract} --pretrained_path BASE --delta_path DELTA --output_path OUT [--shards N]
    accessory weights merge-lora SRC [SRC ...] DST [--shards N]
    accessory reshard SRC DST --shards N
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional

from accessory import __version__
from accessory.config_file import add_config_arg, parse_args, parsers, verb_parsers
from accessory.errors import AccessoryError, FailedInStep


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accessory", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"accessory {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)

    gen = verbs.add_parser("generate", help="complete a prompt (run under torchrun for tensor parallelism)")
    add_model_args(gen)
    sampling = add_sampling_args(gen)
    sampling.add_argument("--prompt", required=True)
    sampling.add_argument("--chat", action="store_true",
                          help="wrap the prompt in the model's chat template; stop at its end-of-turn token")
    add_image_args(gen, "an image for a vision-language model: it goes where the prompt says <image>, else right "
                   "after BOS (with --chat: at the start of the user's message)")
    gen.set_defaults(handler=run_generate)

    chat = verbs.add_parser("chat", help="multi-turn chat in the terminal (rank 0 reads it under torchrun)")
    add_model_args(chat)
    sampling = add_sampling_args(chat)
    sampling.add_argument("--template", help="a LLaMA2-Accessory conversation template name (default: the "
                          "model's own chat template)")
    sampling.add_argument("--system", help="system message for every conversation")
    add_image_args(chat, "an image for a vision-language model: every conversation is about it (it opens the first "
                   "user message, again after /reset)")
    chat.set_defaults(handler=run_chat)
    _add_batch_verb(verbs)

    serve = verbs.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching (run under "
                             "torchrun for tensor parallelism; rank 0 listens)")
    add_model_args(serve)
    http = serve.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    http.add_argument("--port", type=positive_int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("ACCESSORY_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                      "(default: $ACCESSORY_API_KEY; none: no key needed)")
    http.add_argument("--model-name", help="the model id clients name (default: the checkpoint folder's name)")
    http.add_argument("--template", help="a LLaMA2-Accessory conversation template for chat (default: the "
                      "model's own chat template)")
    http.add_argument("--max-queue", type=positive_int, default=64,
                      help="requests that may wait for a free row; past it, 429")
    http.add_argument("--shutdown-grace", type=_non_negative_float, default=30.0,
                      help="on SIGTERM, seconds to let running requests finish before cancelling them")
    http.add_argument("--max-request-bytes", type=_byte_size,
                      help="largest request body accepted, e.g. 8MB; past it, 413 (default: 8MB; for a model that "
                      "reads images, plus --max-image-bytes in base64, so that one image at that limit fits: 36MB at "
                      "the defaults)")
    http.add_argument("--sse-keepalive", type=_positive_float, default=10.0, metavar="SECONDS",
                      help="a stream with nothing to send for this long sends an SSE comment, so proxies keep it "
                      "open (default: 10)")
    http.add_argument("--allow-special-tokens-in-prompt", action="store_true",
                      help="read special tokens' text in a completion's prompt as those tokens (in chat messages "
                      "it is always plain text)")
    _add_server_image_args(serve)
    serve.set_defaults(handler=run_serve, max_seq_len=2048, max_batch_size=16)

    _add_convert_verb(verbs)
    _add_quantize_verb(verbs)
    _add_inspect_verb(verbs)
    _add_weights_verb(verbs)
    _add_reshard_verb(verbs)
    add_log_level(parser)
    both_spellings(parser)
    return parser


def add_image_args(parser: argparse.ArgumentParser, file_help: Optional[str] = None):
    """--image-transform (and --image FILE when `file_help` is given): how an image reaches a vision-language
    model (llama_type llava)."""
    images = parser.add_argument_group("images (a vision-language model)")
    if file_help:
        images.add_argument("--image", metavar="FILE", help=file_help)
    images.add_argument("--image-transform", type=_image_transform, default="padded_resize", metavar="NAME",
                        help="how an image becomes the model's pixels: padded_resize pads it to a square first, as "
                        "LLaVA-1.5 was trained; resized_center_crop crops the middle square (default: padded_resize)")
    return images


def _add_server_image_args(serve: argparse.ArgumentParser) -> None:
    from accessory.data.images import ImageLimits

    images = add_image_args(serve)
    images.add_argument("--allow-local-images", action="store_true",
                        help="let image_url parts name files on this machine (file:///abs/path or /abs/path), read "
                        "with the server's permissions (default: off: data: URLs only; remote URLs are always "
                        "refused, never fetched)")
    images.add_argument("--max-image-bytes", type=_byte_size, default=ImageLimits.max_bytes, metavar="SIZE",
                        help="largest image accepted, encoded, e.g. 5MB; past it, 400 (default: 20MiB)")
    images.add_argument("--max-image-pixels", type=positive_int, default=ImageLimits.max_pixels, metavar="N",
                        help="largest image accepted, width x height, checked before any pixel is decoded; past "
                        f"it, 400 (default: {ImageLimits.max_pixels})")


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """--log-level on every verb that runs (`weights apply`, not `weights`)."""
    for verb in parsers(parser):
        if verb is parser or verb_parsers(verb):
            continue
        verb.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                          help="what rank 0 logs (the other ranks log warnings and errors; every rank at debug) "
                          "(default: info)")


def both_spellings(parser: argparse.ArgumentParser) -> None:
    """Let every long flag of `parser` and its verbs take both spellings: --max-batch-size as vLLM and llama.cpp
    spell it, --max_batch_size as LLaMA2-Accessory does."""
    for each in parsers(parser):
        for action in each._actions:
            for option in list(action.option_strings):
                words = option[2:]
                other = "--" + (words.replace("_", "-") if "_" in words else words.replace("-", "_"))
                if option.startswith("--") and other != option and other not in each._option_string_actions:
                    action.option_strings.append(other)
                    each._option_string_actions[other] = action


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_config_arg(parser)
    model = parser.add_argument_group("model")
    model.add_argument("--pretrained_path", nargs="+", help="checkpoint folder(s), later ones overriding earlier "
                       "ones (default: the built-in SmolLM2-135M-Instruct, imported on first use)")
    model.add_argument("--llama_type", help="model type (default: meta.json's, else llama)")
    model.add_argument("--llama_config", nargs="+", default=[], help="config files or presets (llama2-7b, "
                       "llama3.1-8b, llamaPeft_normBiasLora, ...: docs/configs.md) overriding the folder's "
                       "(default: none)")
    model.add_argument("--tokenizer_path", help="tokenizer.model / tokenizer.json (default: found beside weights)")
    model.add_argument("--chat-template", metavar="FILE", type=_chat_template_file,
                       help="a Jinja chat template file (Hugging Face's format) used instead of the model's own, for "
                       "chats: generate --chat, chat, serve, batch's messages, the demos (default: the model's own)")
    model.add_argument("--max_seq_len", type=positive_int, default=4096)
    model.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, fp32 on CPU")
    model.add_argument("--device", help="default: cuda if available, else cpu")
    model.add_argument("--quant", nargs="?", const="int8", choices=["int8", "int4"],
                       help="weight-only quantization while loading (--quant alone: int8; int4: the blocks' linears "
                       "in int4, the embedding in int8); a quantized checkpoint loads in its own format. With the "
                       "built-in model, int4 runs the GGUF file's own Q4_1 bits")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--rank-timeout", type=_positive_float, default=60.0,
                        help="seconds after which a rank that stopped answering (frozen, lost) ends every rank, "
                        "named in the log (exit status 3); under torchrun only")
    engine.add_argument("--max_batch_size", type=positive_int, default=32,
                        help="rows decoded together; more requests wait for a free row")
    engine.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile "
                        "(CUDA graphs on CUDA): tens of seconds once, faster steps after")
    engine.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefill every prompt "
                        "in full (by default a prompt's start already in the KV cache is reused: a shared system "
                        "prompt, a chat's earlier turns)")
    engine.add_argument("--prefix-cache-bytes", type=_byte_size, default=256 << 20, metavar="SIZE",
                        help="per rank, the KV-cache memory for finished sequences kept for later prompts to reuse, "
                        "e.g. 1GB (default: 256MiB, at most as many rows as --max_batch_size)")


def add_sampling_args(parser: argparse.ArgumentParser):
    sampling = parser.add_argument_group("generation")
    sampling.add_argument("--max_gen_len", type=positive_int, default=512)
    sampling.add_argument("--temperature", type=_non_negative_float, default=0.0,
                          help="0 (or below 1e-5) = greedy")
    sampling.add_argument("--top_p", type=_probability, default=0.95)
    sampling.add_argument("--top_k", type=_non_negative_int, default=0, help="0 = no top-k cut")
    sampling.add_argument("--repetition_penalty", type=_penalty, default=1.0, help="1 = off; 0.01 to 100")
    sampling.add_argument("--seed", type=int, help="makes sampling reproducible")
    return sampling


def _sampling_kwargs(args) -> dict:
    return dict(max_gen_len=args.max_gen_len, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def load_model(args, mp_group=None, warmup: bool = False):
    """Every rank loads the model (onto `mp_group`, default the world); with no --pretrained_path, the built-in one
    (imported once per node). `warmup`: with --compile, compile every graph before returning (what serves many
    requests: no request then waits on compilation)."""
    import torch.distributed as dist

    from accessory.checkpoint.default_model import ensure_default_model
    from accessory.model.meta import MetaModel

    paths = args.pretrained_path
    if not paths:
        keep_bits = args.quant == "int4"  # the GGUF's own Q4_1 weights, as llama.cpp runs them
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one process per node imports it; the others wait
            ensure_default_model(keep_bits)
        if dist.is_initialized():
            dist.barrier()
        paths = [ensure_default_model(keep_bits)]
    model = MetaModel.from_pretrained(paths, llama_type=args.llama_type, llama_config=args.llama_config,
                                      tokenizer_path=args.tokenizer_path, max_seq_len=args.max_seq_len,
                                      dtype=args.dtype, device=args.device, mp_group=mp_group, quant=args.quant,
                                      max_batch_size=args.max_batch_size, compile=args.compile,
                                      prefix_cache=args.prefix_cache, prefix_cache_bytes=args.prefix_cache_bytes,
                                      rank_timeout=getattr(args, "rank_timeout", 60.0), warmup=warmup)
    if args.chat_template:
        model.tokenizer.set_chat_template(args.chat_template)
        model.stop_ids = model.tokenizer.chat_stop_ids  # EOS and the new template's end-of-turn token
    return model


def run_generate(args) -> None:
    image = _read_image(args)
    model = load_model(args)
    pixels = _image_pixels(model, image, args)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        text = model.chat(_with_image(messages, args), image=pixels, **_sampling_kwargs(args))
    else:
        [text] = model.generate([args.prompt], images=None if pixels is None else [pixels], **_sampling_kwargs(args))
    if model.ctx.is_source:
        print(text, flush=True)


def _read_image(args):
    """--image, read by global rank 0 before any model loads (None on the other ranks, and without --image); a bad
    file stops every rank, with one message."""
    if not getattr(args, "image", None):
        return None
    from accessory.batch import on_rank0
    from accessory.data.images import ImageError, read_image_file
    from accessory.parallel import ParallelContext

    def read():
        try:
            return read_image_file(args.image)
        except ImageError as e:
            raise ImageError(f"--image {e}") from None

    return on_rank0(ParallelContext.from_group(None), read)


def _image_pixels(model, image, args):
    """The pixels of --image for the source rank's generation (None on the others: the source rank's are sent to
    them), or None without --image."""
    if not getattr(args, "image", None):
        return None
    from accessory.batch import image_pixels, on_rank0
    from accessory.data.images import ImageError

    def pixels():
        if not model.llma.image_tokens:
            raise ImageError(f"--image {args.image}: this model ({model.llama_type}) reads text only; a "
                             f"vision-language checkpoint (llama_type llava) reads images")
        return image_pixels(model, image, args.image_transform, f"--image {args.image}")

    return on_rank0(model.ctx, pixels)


def _with_image(messages: list[dict], args) -> list[dict]:
    """With --image, the messages with its placeholder opening the first user message (LLaVA's place for it)."""
    if not args.image:
        return messages
    from accessory.generation.chat import with_image_placeholder

    return with_image_placeholder(messages)


CHAT_HELP = "Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits."


def run_chat(args) -> None:
    """Rank 0 reads the terminal and broadcasts each line; every rank generates; rank 0 streams the reply."""
    image = _read_image(args)
    model = load_model(args)
    pixels = _image_pixels(model, image, args)
    source = model.ctx.is_source
    if not source:  # the terminal's Ctrl-C reaches every rank; the source turns it into a clean end for all
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if source:
        print(CHAT_HELP, flush=True)
    while True:
        line = _next_line(model.ctx)
        if line is None or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(system)
            if source:
                print("(new conversation)", flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for event in model.stream_chat(_with_image(messages, args), template=args.template, image=pixels,
                                       **_sampling_kwargs(args)):
            reply = event.text
            if source:
                print(event.delta, end="", flush=True)
        if source:
            print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def run_serve(args) -> None:
    from accessory.data.images import ImageLimits
    from accessory.serve.images import ImageOptions
    from accessory.serve.server import serve

    name = args.model_name or (os.path.basename(os.path.normpath(args.pretrained_path[-1])) if args.pretrained_path
                               else DEFAULT_MODEL_NAME)
    images = ImageOptions(ImageLimits(args.max_image_bytes, args.max_image_pixels), args.allow_local_images,
                          args.image_transform)
    serve(lambda: load_model(args), args.host, args.port, name, args.api_key, args.template, args.max_queue,
          args.shutdown_grace, max_request_bytes=args.max_request_bytes,
          special_tokens_in_prompt=args.allow_special_tokens_in_prompt, keepalive_s=args.sse_keepalive,
          images=images)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
KEEPALIVE_S = 30.0  # while the user types, how often the source rank tells the others it is still waiting
_STILL_WAITING = ("still waiting",)


def _next_line(ctx):
    """The user's next line (None to end) on every rank. The other ranks wait for it in a collective, which would
    time out if the user took long: meanwhile the source rank sends a keep-alive from a thread. The main thread does
    the reading, so the terminal's Ctrl-C interrupts the read itself (Python runs signal handlers there)."""
    if not ctx.is_source:
        while True:
            line = ctx.broadcast_object(None)
            if line != _STILL_WAITING:
                return line
    if ctx.world_size == 1:
        return _read_line("user> ")
    with _KeepAlive(ctx):
        line = _read_line("user> ")
    return ctx.broadcast_object(line)


class _KeepAlive:
    """While the source rank waits for the user, tell the other ranks every KEEPALIVE_S that it is still waiting;
    leaving the block stops it before the next broadcast (so the line itself follows in order)."""

    def __init__(self, ctx):
        self.ctx, self.stopped, self.sending = ctx, threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._run, name="accessory-keepalive", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(KEEPALIVE_S):
            with self.sending:
                if not self.stopped.is_set():
                    self.ctx.broadcast_object(_STILL_WAITING)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def _read_line(prompt: str):
    """A line from the terminal, or None on Ctrl-D / Ctrl-C (then every rank ends cleanly)."""
    # Not input(): without the readline module it writes the prompt to stderr, where logs go.
    print(prompt, end="", flush=True)
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line:
        print(flush=True)
        return None
    return line.rstrip("\n")


def _add_batch_verb(verbs) -> None:
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
    job.add_argument("--batch_size", type=positive_int, help="rows in flight per group (the same as "
                     "--max_batch_size, which it overrides; default 8)")
    add_image_args(batch)
    batch.set_defaults(handler=run_batch, max_batch_size=8)


def run_batch(args) -> None:
    from pathlib import Path

    from accessory.batch import BatchOptions, run_batch as run

    args.max_batch_size = args.batch_size or args.max_batch_size
    options = BatchOptions(Path(args.input), Path(args.output), args.mp, args.max_batch_size, args.template,
                           args.max_seq_len, args.image_transform)
    run(options, _sampling_kwargs(args), lambda group: load_model(args, group, warmup=True))


def _add_weights_verb(verbs):
    """`accessory weights OPERATION`: one subcommand per operation on checkpoint weights (add more to `operations`)."""
    weights = verbs.add_parser("weights", help="operate on checkpoint weights on disk (delta apply / extract)")
    operations = weights.add_subparsers(dest="operation", required=True)
    apply = operations.add_parser("apply", help="base + delta (model-diff folder) -> a plain checkpoint")
    add_delta_args(apply, "the delta folder (consolidated.NN-of-MM.model-diff.pth shards)")
    apply.set_defaults(handler=run_weight_operate, operate_type="apply")
    extract = operations.add_parser("extract", help="fine-tuned - base -> a delta (model-diff) folder")
    add_delta_args(extract, "the fine-tuned checkpoint folder (LLaMA2-Accessory's name for it in extract mode)")
    extract.set_defaults(handler=run_weight_operate, operate_type="extract")
    merge = operations.add_parser("merge-lora", help="fold a llama_peft checkpoint's LoRA into a plain llama one")
    merge.add_argument("src", nargs="+", help="the llama_peft checkpoint folder, or its base folder followed by the "
                       "trainable-only folder(s), later ones overriding earlier ones")
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


def _add_reshard_verb(verbs) -> None:
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


def _add_convert_verb(verbs) -> None:
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
    conv.add_argument("--max_shard_size", type=_byte_size, default=5 << 30,
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


def _add_quantize_verb(verbs) -> None:
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


def _add_inspect_verb(verbs) -> None:
    inspect = verbs.add_parser("inspect", help="describe a checkpoint (format, shards, dtype, parameters, config, "
                               "tokenizer) and check every shard; exit 1 naming the problems if any")
    inspect.add_argument("path", help="a checkpoint folder (accessory, Meta, HF, DCP) or a .gguf file")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.add_argument("--ranks", type=positive_int, help="a mixture of experts: also show which experts each of "
                         "this many ranks would hold")
    inspect.set_defaults(handler=run_inspect)


def run_inspect(args) -> None:
    import json
    from pathlib import Path

    from accessory.checkpoint.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(Path(args.path), args.ranks)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report), flush=True)
    if report.problems:
        sys.exit(1)


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "KIB": 1 << 10, "MIB": 1 << 20,
          "GIB": 1 << 30}


def _byte_size(text: str) -> int:
    """'5GB', '500MB', '40KB' or a plain byte count (decimal units, as transformers' max_shard_size)."""
    number = text.rstrip("KMGiBkmgib")
    unit = text[len(number):].upper()
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB, 500MB or 40000, got {text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def main(argv=None) -> None:
    args = parse_args(build_parser(), argv)
    run(args.handler, args)


def run(handler, args) -> None:
    """Run `handler(args)` on this rank as every entry point does (the verbs, the demos): join torchrun's group, log
    to stderr, and leave the group cleanly; bad input exits 2 with its message, Ctrl-C 130."""
    from accessory.parallel import init_distributed, shutdown_distributed

    init_distributed()
    _setup_logging(args)
    if getattr(args, "rank_timeout", None) is not None:
        from accessory.parallel.watchdog import start_watchdog

        start_watchdog(args.rank_timeout)
    try:
        handler(args)
    except FailedInStep as e:  # the other ranks ended normally: the closing barrier is safe
        logging.getLogger("accessory").error("%s", e)
        shutdown_distributed()
        sys.exit(2)
    except AccessoryError as e:
        logging.getLogger("accessory").error("%s", e)
        _leave_without_barrier()
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: end quietly, as a shell expects (status 130)
        _leave_without_barrier()
        sys.exit(130)
    except BaseException:
        from accessory.parallel.watchdog import await_verdict_on_silent_ranks

        # a collective that failed because a peer froze (killed meanwhile by another rank's watchdog): this rank's
        # watchdog is about to end it too, naming that rank, with EXIT_RANK_LOST; a traceback would come first
        await_verdict_on_silent_ranks()
        _leave_without_barrier()
        raise
    shutdown_distributed()


def _leave_without_barrier() -> None:
    # After a failure other ranks may be elsewhere: a barrier could hang. Leave, and let torchrun end the rest.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _setup_logging(args) -> None:
    """Timestamped lines to stderr: rank 0's at --log-level, the other ranks' warnings and errors (all of them at
    debug)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    level = getattr(logging, (getattr(args, "log_level", None) or "info").upper())
    quiet = rank > 0 and level > logging.DEBUG
    logging.basicConfig(stream=sys.stderr, level=max(level, logging.WARNING) if quiet else level,
                        format=f"%(asctime)s [accessory rank {rank}] %(levelname)s %(message)s")


def _checked(convert, ok, expected: str):
    """An argparse type: `convert` the text, then refuse values that are not `ok`, saying what was expected."""
    def parse(value: str):
        try:
            x = convert(value)
        except ValueError:  # "eight": the same message as for 0
            x = None
        if x is None or not ok(x):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return x
    return parse


def _image_transform(name: str) -> str:
    from accessory.data.transform import TRANSFORMS

    if name not in TRANSFORMS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(TRANSFORMS)}, got {name}")
    return name


def _chat_template_file(path: str) -> str:
    """--chat-template: a file that reads and compiles as a chat template (checked before any model loads)."""
    from accessory.text.tokenizer import read_chat_template

    try:
        read_chat_template(path)
    except AccessoryError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


positive_int = _checked(int, lambda n: n > 0, "a positive integer")
_non_negative_int = _checked(int, lambda n: n >= 0, ">= 0")
_non_negative_float = _checked(float, lambda x: 0 <= x < float("inf"), "a finite number >= 0")
_positive_float = _checked(float, lambda x: 0 < x < float("inf"), "a finite number > 0")
_probability = _checked(float, lambda x: 0 < x <= 1, "in (0, 1]")


def _penalty(text: str) -> float:
    from accessory.generation.sampling import REPETITION_PENALTY_RANGE

    low, high = REPETITION_PENALTY_RANGE
    return _checked(float, lambda x: low <= x <= high, f"in [{low}, {high}]")(text)
