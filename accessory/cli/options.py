"""The arguments the verbs share (model, engine, sampling, images, log level), both spellings of every flag, and
the argparse types that refuse a bad value naming what was expected."""
from __future__ import annotations

import argparse
from typing import Optional

from accessory.config_file import add_config_arg, parsers, verb_parsers
from accessory.errors import AccessoryError
from accessory.runtime.load_options import LoadOptions


def add_image_args(parser: argparse.ArgumentParser, file_help: Optional[str] = None):
    """--image-transform (and --image FILE when `file_help` is given): how an image reaches a vision-language
    model (llama_type llava)."""
    images = parser.add_argument_group("images (a vision-language model)")
    if file_help:
        images.add_argument("--image", metavar="FILE", help=file_help)
    images.add_argument("--image-transform", type=image_transform_name, default="padded_resize", metavar="NAME",
                        help="how an image becomes the model's pixels: padded_resize pads it to a square first, as "
                        "LLaVA-1.5 was trained; resized_center_crop crops the middle square (default: padded_resize)")
    return images


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


def pipeline_layers(text: str) -> str:
    """--pp-layers: even, balanced, auto, or whole numbers >= 1 separated by commas (checked against --pp and the
    model's layer count once it is read)."""
    if text in ("even", "balanced", "auto") or all(part.strip().isdigit() and int(part) >= 1
                                                   for part in text.split(",")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected even, balanced, auto, or a layer count per stage such as "
                                     f"12,18")


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
    model.add_argument("--chat-template", metavar="FILE", type=chat_template_file,
                       help="a Jinja chat template file (Hugging Face's format) used instead of the model's own, for "
                       "chats: generate --chat, chat, serve, batch's messages, the demos (default: the model's own)")
    model.add_argument("--lora", metavar="PATH", help="a Hugging Face PEFT LoRA adapter folder (adapter_config.json + "
                       "adapter_model.safetensors) applied to every request, unmerged and in float (a quantized "
                       "base stays quantized); `accessory weights merge-lora` writes it merged (default: none)")
    model.add_argument("--max_seq_len", type=positive_int, default=LoadOptions.max_seq_len)
    model.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, fp32 on CPU")
    model.add_argument("--device", help="default: cuda if available, else cpu")
    model.add_argument("--quant", nargs="?", const="int8", choices=["int8", "int4"],
                       help="weight-only quantization while loading (--quant alone: int8; int4: the blocks' linears "
                       "in int4, the embedding in int8); a quantized checkpoint loads in its own format. With the "
                       "built-in model, int4 runs the GGUF file's own Q4_1 bits")
    ranks = parser.add_argument_group("ranks (under torchrun: world = data-parallel x pipeline x tensor)")
    ranks.add_argument("--pp", dest="pipeline_parallel_size", type=positive_int, default=1, metavar="N",
                       help="pipeline stages: the model-parallel ranks split into N stages of consecutive ranks, each "
                       "holding a contiguous run of layers and tensor-parallel inside; a stage per machine sends one "
                       "activation a token across the network (docs/multinode.md; default: 1)")
    ranks.add_argument("--pp-layers", dest="pipeline_layers", type=pipeline_layers,
                       metavar="even|balanced|auto|A,B,...",
                       help="how the layers split over the --pp stages: even (default), balanced (each stage's work a "
                       "token about the same, the head counted: the most tokens a second with many requests), auto "
                       "(by each stage's memory budget: its cgroup limit, available RAM or free GPU memory) or a "
                       "count per stage, e.g. 12,18")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--rank-timeout", type=positive_float, default=LoadOptions.rank_timeout,
                        help="seconds after which a rank that stopped answering (frozen, lost) ends every rank, "
                        "named in the log (exit status 3); under torchrun only")
    engine.add_argument("--max_batch_size", type=rows_or_auto, default=LoadOptions.max_batch_size,
                        help="rows decoded together; more requests wait for a free row. auto: as many as the KV "
                        "cache at --max_seq_len fits in the memory each rank has once loaded, less a margin "
                        "(the arithmetic is logged)")
    engine.add_argument("--exact-products", dest="exact_products", action="store_true",
                        help="multiply a GGUF's Q4_K / Q5_K / Q6_K / Q5_0 weights in float32 at every prompt length, "
                        "as transformers does (by default a prompt's products, and a batch-1 step's Q5_0, Q4_K and "
                        "Q6_K ones, quantize x to int8, as llama.cpp does: about 2.5x faster prompts, faster decoding, "
                        "greedy tokens that may part from transformers' at a near tie)")
    engine.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile "
                        "(CUDA graphs on CUDA): tens of seconds once, faster steps after")
    engine.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                        help='speculative decoding, as vLLM configures it (same output, several tokens a step): '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\' proposes tokens found in the prompt and '
                        'output; \'{"model": "self", "quant": "int4"}\' drafts with the model itself in int4; '
                        '\'{"model": PATH}\' with a draft checkpoint (docs/speculative.md)')
    engine.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefill every prompt "
                        "in full (by default a prompt's start already in the KV cache is reused: a shared system "
                        "prompt, a chat's earlier turns)")
    engine.add_argument("--prefix-cache-bytes", type=byte_size, default=LoadOptions.prefix_cache_bytes,
                        metavar="SIZE",
                        help="per rank, the KV-cache memory for finished sequences kept for later prompts to reuse, "
                        "e.g. 1GB (default: 256MiB, at most as many rows as --max_batch_size)")


def add_sampling_args(parser: argparse.ArgumentParser):
    sampling = parser.add_argument_group("generation")
    sampling.add_argument("--max_gen_len", type=positive_int, default=512)
    sampling.add_argument("--temperature", type=non_negative_float, default=0.0,
                          help="0 (or below 1e-5) = greedy")
    sampling.add_argument("--top_p", type=probability, default=0.95)
    sampling.add_argument("--top_k", type=non_negative_int, default=0, help="0 = no top-k cut")
    sampling.add_argument("--repetition_penalty", type=penalty, default=1.0, help="1 = off; 0.01 to 100")
    sampling.add_argument("--seed", type=int, help="makes sampling reproducible")
    return sampling


def sampling_kwargs(args) -> dict:
    return dict(max_gen_len=args.max_gen_len, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "KIB": 1 << 10, "MIB": 1 << 20,
          "GIB": 1 << 30}


def byte_size(text: str) -> int:
    """'5GB', '500MB', '40KB' or a plain byte count (decimal units, as transformers' max_shard_size)."""
    number = text.rstrip("KMGiBkmgib")
    unit = text[len(number):].upper()
    try:
        value = int(float(number) * UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB, 500MB or 40000, got {text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules NAME=PATH (vLLM's spelling): the name requests give as `model`, and a PEFT adapter folder."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be NAME=PATH (a name for requests' model field = a PEFT adapter "
                                         f"folder), got {text}")
    return name, path


def checked(convert, ok, expected: str):
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


def speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object that SpeculativeConfig accepts (checked before any model loads; its
    nesting bounded before it is parsed)."""
    from accessory.errors import ConfigError
    from accessory.generation.speculative import SpeculativeConfig
    from accessory.untrusted import json_object

    try:
        values = json_object(text, "--speculative-config", ConfigError)
        SpeculativeConfig.from_dict(values, "--speculative-config")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return values


def image_transform_name(name: str) -> str:
    from accessory.data.transform import TRANSFORMS

    if name not in TRANSFORMS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(TRANSFORMS)}, got {name}")
    return name


def chat_template_file(path: str) -> str:
    """--chat-template: a file that reads and compiles as a chat template (checked before any model loads)."""
    from accessory.text.chat_template import read_chat_template

    try:
        read_chat_template(path)
    except AccessoryError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


positive_int = checked(int, lambda n: n > 0, "a positive integer")
non_negative_int = checked(int, lambda n: n >= 0, ">= 0")
# "auto": sized from the memory once the model is loaded (generation/batch_size.py)
rows_or_auto = checked(lambda text: text if text == "auto" else int(text), lambda n: n == "auto" or n > 0,
                       "a positive integer or auto")
non_negative_float = checked(float, lambda x: 0 <= x < float("inf"), "a finite number >= 0")
positive_float = checked(float, lambda x: 0 < x < float("inf"), "a finite number > 0")
probability = checked(float, lambda x: 0 < x <= 1, "in (0, 1]")


def penalty(text: str) -> float:
    from accessory.generation.sampling import REPETITION_PENALTY_RANGE

    low, high = REPETITION_PENALTY_RANGE
    return checked(float, lambda x: low <= x <= high, f"in [{low}, {high}]")(text)
