"""`accessory serve`: the OpenAI-compatible HTTP server's flags, and starting it."""
from __future__ import annotations

import argparse
import os

from accessory.cli.options import (add_image_args, add_model_args, byte_size, lora_module, non_negative_float,
                                   positive_float, positive_int)
from accessory.cli.process import load_model
from accessory.text.reasoning import REASONING_FORMATS
from accessory.text.tool_calls import FORMATS


def add_serve_verb(verbs) -> None:
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
    http.add_argument("--lora-modules", nargs="+", type=lora_module, metavar="NAME=PATH",
                      help="Hugging Face PEFT LoRA adapters kept unmerged beside the model: a request whose model is "
                      "NAME runs with that adapter, in the same batches as the others; /v1/models lists them "
                      "(default: none)")
    http.add_argument("--template", help="a LLaMA2-Accessory conversation template for chat (default: the "
                      "model's own chat template)")
    http.add_argument("--max-queue", type=positive_int, default=64,
                      help="requests that may wait for a free row; past it, 429")
    http.add_argument("--shutdown-grace", type=non_negative_float, default=30.0,
                      help="on SIGTERM, seconds to let running requests finish before cancelling them")
    http.add_argument("--max-request-bytes", type=byte_size,
                      help="largest request body accepted, e.g. 8MB; past it, 413 (default: 8MB; for a model that "
                      "reads images, plus --max-image-bytes in base64, so that one image at that limit fits: 36MB at "
                      "the defaults)")
    http.add_argument("--sse-keepalive", type=positive_float, default=10.0, metavar="SECONDS",
                      help="a stream with nothing to send for this long sends an SSE comment, so proxies keep it "
                      "open (default: 10)")
    http.add_argument("--allow-special-tokens-in-prompt", action="store_true",
                      help="read special tokens' text in a completion's prompt as those tokens (in chat messages "
                      "it is always plain text)")
    http.add_argument("--tool-call-parser", default="auto", choices=["auto", *FORMATS],
                      help="how a chat reply to a request with tools writes its calls, read back as tool_calls: "
                      "hermes (<tool_call>), llama3_json, mistral ([TOOL_CALLS]), pythonic ([f(a=1)]); auto (the "
                      "default): the one the chat template writes, if any")
    http.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *REASONING_FORMATS],
                      help="keep a reply's reasoning between <think> and </think> apart, as reasoning_content "
                      "(qwen3, deepseek_r1: the same markers); auto (the default): if the chat template writes them")
    add_server_image_args(serve)
    serve.set_defaults(handler=run_serve, max_seq_len=2048, max_batch_size=16)


def add_server_image_args(serve: argparse.ArgumentParser) -> None:
    from accessory.data.images import ImageLimits

    images = add_image_args(serve)
    images.add_argument("--allow-local-images", action="store_true",
                        help="let image_url parts name files on this machine (file:///abs/path or /abs/path), read "
                        "with the server's permissions (default: off: data: URLs only; remote URLs are always "
                        "refused, never fetched)")
    images.add_argument("--max-image-bytes", type=byte_size, default=ImageLimits.max_bytes, metavar="SIZE",
                        help="largest image accepted, encoded, e.g. 5MB; past it, 400 (default: 20MiB)")
    images.add_argument("--max-image-pixels", type=positive_int, default=ImageLimits.max_pixels, metavar="N",
                        help="largest image accepted, width x height, checked before any pixel is decoded; past "
                        f"it, 400 (default: {ImageLimits.max_pixels})")


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def run_serve(args) -> None:
    from accessory.data.images import ImageLimits
    from accessory.errors import ConfigError
    from accessory.serve.images import ImageOptions
    from accessory.serve.server import serve

    name = args.model_name or (os.path.basename(os.path.normpath(args.pretrained_path[-1])) if args.pretrained_path
                               else DEFAULT_MODEL_NAME)
    names = [module for module, _ in args.lora_modules or ()]
    if len(set(names)) != len(names) or name in names:
        raise ConfigError(f"--lora-modules: each NAME must be unique and differ from the model's name {name!r}, got "
                          f"{names}")
    images = ImageOptions(ImageLimits(args.max_image_bytes, args.max_image_pixels), args.allow_local_images,
                          args.image_transform)
    serve(lambda: load_model(args), args.host, args.port, name, args.api_key, args.template, args.max_queue,
          args.shutdown_grace, max_request_bytes=args.max_request_bytes,
          special_tokens_in_prompt=args.allow_special_tokens_in_prompt, keepalive_s=args.sse_keepalive,
          images=images, tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
