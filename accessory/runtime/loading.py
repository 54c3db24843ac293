"""Loading a model for MetaModel: the process group, the config and tokenizer checked before any weight is read,
the network built on the meta device, quantized if asked, given memory, and each rank's slice of every tensor copied
in (resharding as needed)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from accessory.checkpoint.config import CheckpointSpec, read_spec, resolved_config
from accessory.checkpoint.direct import imported
from accessory.checkpoint.load import load_weights
from accessory.checkpoint.peft_adapter import attach_adapters, read_adapter
from accessory.errors import ConfigError, TokenizerError
from accessory.generation.batch_size import AUTO, auto_batch_size
from accessory.generation.engine import EngineSettings
from accessory.generation.speculative import SpeculativeConfig
from accessory.kernels import cpu_kernels
from accessory.kernels.dispatch import exact_products
from accessory.network.LLM import model_classes
from accessory.network.memory import back_with_huge_pages, check_fits, return_freed_memory, weight_bytes
from accessory.parallel import ParallelContext, fairscale_model_parallel_group, init_distributed, share_cores
from accessory.parallel.context import leave_at_exit, warn_if_ranks_crowd_cores
from accessory.parallel.layers import repack_int4_for_int8x
from accessory.parallel.pipeline import Stage, pipeline_stage
from accessory.parallel.watchdog import start_watchdog
from accessory.runtime.load_options import LoadOptions, PathLike
from accessory.runtime.placement import (check_stage_count, describe_plan, fitting_stages, kv_row_bytes, layer_split,
                                         model_sizes, stage_budgets)
from accessory.text.tokenizer import Tokenizer, find_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class Loaded:
    """What `load` gives MetaModel: the network (eval mode, its slice on this rank), the tokenizer, the llama_type
    and the engine's settings; and speculative decoding's draft network, if it has one."""
    llma: nn.Module
    tokenizer: Tokenizer
    llama_type: str
    settings: EngineSettings
    draft: Optional[nn.Module] = None
    adapter_names: tuple[str, ...] = ()  # the per-request adapters (lora_modules): name of adapter 1, 2, ...


def load(options: LoadOptions) -> Loaded:
    """`MetaModel.from_pretrained` without the warm-up (its docstring says what each option means)."""
    paths = options.pretrained_path
    folders = [imported(Path(p)) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    compile, quant, rank_timeout = options.compile, options.quant, options.rank_timeout
    exact_products(options.exact_products)
    speculative = SpeculativeConfig.from_dict(options.speculative_config)
    if speculative is not None:
        speculative.check_window(options.max_seq_len)  # before any weight is read
    auto_rows = options.max_batch_size == AUTO  # sized once the model is loaded (generation/batch_size.py)
    settings = EngineSettings(max_batch_size=1 if auto_rows else options.max_batch_size, compile=compile,  # checked
                              prefix_cache=options.prefix_cache, prefix_cache_bytes=options.prefix_cache_bytes,
                              speculative=speculative)
    adapters = adapter_paths(options.lora, options.lora_modules, compile, speculative)
    mp_group = options.mp_group
    if mp_group is None:
        init_distributed()  # a script started by torchrun needs no set-up of its own
        mp_group = fairscale_model_parallel_group()
    if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
        raise ConfigError(f"rank_timeout must be a number of seconds > 0, got {rank_timeout!r}")
    share_cores()
    ctx = ParallelContext.from_group(mp_group, rank_timeout)
    if ctx.world_size > 1:
        start_watchdog(rank_timeout)
        leave_at_exit(rank_timeout)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    if device.type == "cpu" and not compile:
        warn_if_ranks_crowd_cores(ctx)

    spec = read_spec(folders, options.llama_type, [str(p) for p in options.llama_config or ()])
    tokenizer = Tokenizer.from_path(options.tokenizer_path or found_tokenizer(folders))
    _, transformer = model_classes(spec.llama_type)
    if options.with_visual and not hasattr(transformer, "image_features"):
        raise ConfigError(f"with_visual=True, but {folders[-1]} holds a text model (llama_type "
                          f"{spec.llama_type!r}); vision-language checkpoints are llama_type 'llava' (import an "
                          f"HF LLaVA folder with `accessory convert hf`)")
    draft_folders = None
    if speculative is not None and speculative.model is not None:
        draft_folders = folders if speculative.model == "self" else [imported(Path(speculative.model))]
        if speculative.model == "self":
            check_self_draft(spec, quant, speculative.quant, folders[-1])
    stages = check_stage_count(options.pipeline_parallel_size, ctx.world_size)
    if stages > 1 and speculative is not None:
        raise ConfigError(f"speculative decoding does not run under a pipeline (--pp {stages}) yet; drop "
                          f"speculative_config (--speculative-config), or run without --pp")
    llma = load_network(folders, spec, tokenizer, ctx, options.max_seq_len, dtype, device, quant, adapters, stages,
                        options.pipeline_layers)
    draft = None
    if draft_folders is not None:
        draft_spec = spec
        if draft_folders is not folders:  # "self" reads the target's own files: nothing to compare
            draft_spec = read_spec(draft_folders, None, [])
            check_draft_tokenizer(tokenizer, draft_folders)
        draft = load_network(draft_folders, draft_spec, tokenizer, ctx, options.max_seq_len, dtype, device,
                             speculative.quant)
        added = repack_int4_for_int8x(draft)  # its proposals are verified: x in int8 is exact enough
        if added:
            log.info("draft: int4 products with x in int8 (%d MiB of repacked weights)", added >> 20)
        if hasattr(llma, "image_features") and not hasattr(draft, "image_features"):
            raise ConfigError(f"speculative_config model {speculative.model!r} reads text only; the target "
                              f"{folders[-1]} reads images: its draft must too")
    if auto_rows:
        reserved = settings.prefix_cache_bytes if settings.prefix_cache else 0
        settings = replace(settings, max_batch_size=auto_batch_size(llma, reserved))
    return Loaded(llma, tokenizer, spec.llama_type, settings, draft, tuple(options.lora_modules or ()))


def adapter_paths(lora: Optional[PathLike], lora_modules: Optional[dict[str, PathLike]], compile: bool,
                  speculative: Optional[SpeculativeConfig]) -> list[tuple[int, Path]]:
    """(owner, folder) of each PEFT adapter to attach (checkpoint/peft_adapter.py): `lora` for every token (owner
    0), `lora_modules`' in their order for the requests that name them (owners 1, 2, ...)."""
    modules = dict(lora_modules or {})
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lora_modules names must be non-empty strings, got {name!r}")
    if modules and (compile or speculative is not None):
        raise ConfigError("lora_modules (adapters chosen per request) run eagerly and without speculative "
                          "decoding; drop compile / speculative_config, or merge the adapter (accessory weights "
                          "merge-lora) or load it for every request (lora=)")
    adapters = [(0, Path(lora))] if lora is not None else []
    return adapters + [(owner, Path(path)) for owner, path in enumerate(modules.values(), start=1)]


def load_network(folders: list[Path], spec: CheckpointSpec, tokenizer: Tokenizer, ctx: ParallelContext,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device, quant,
                 adapters: Sequence[tuple[int, Path]] = (), stages: int = 1,
                 stage_layers: Optional[str] = None) -> nn.Module:
    """The network of `folders` (read as `spec`), built on the meta device, quantized as `quant` says, with this
    rank's slice of every weight, in eval mode; with the PEFT `adapters` ((owner, folder): adapter_paths) attached
    unmerged, in float. `stages`: pipeline stages over `ctx`'s ranks (a count `check_stage_count` passed), their
    layers split as `stage_layers` says (runtime/placement.py); this rank builds and reads only its stage's."""
    model_args, transformer = model_classes(spec.llama_type)
    config = resolved_config({**spec.config, "max_seq_len": max_seq_len}, tokenizer, str(folders[-1]))
    args = model_args.from_dict(config, source=f"config of {folders[-1]}")
    if tokenizer.n_words > args.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.n_words} tokens but the model's vocab_size is "
                          f"{args.vocab_size}: they do not belong together")
    tp = ctx.world_size // stages
    args.check_parallel_size(tp)  # before any weight is read

    def build(stage: Stage) -> nn.Module:
        llma = transformer(args, ctx, stage)
        formats = quantized_formats(llma, spec, quant, folders[-1])
        if formats:
            llma.quantize_(formats)
        return llma

    sizes = functools.cache(lambda: model_sizes(build, args.n_layers, tp, dtype))
    split = layer_split(args.n_layers, stages, stage_layers, sizes, lambda: stage_budgets(ctx, stages, device))
    stage = pipeline_stage(ctx, split)
    if stages > 1 and ctx.is_source:
        log.info("pipeline of %d stages x %d tensor rank(s):\n%s", stages, tp,
                 describe_plan(split, tp, sizes(), kv_row_bytes(args, split, tp, dtype)))
    llma, error = None, None
    try:
        with torch.device("meta"):
            llma = build(stage)
    except ConfigError as e:  # a rank whose slice does not fall on whole blocks: the others must hear of it too
        error = e
    ctx.raise_if_any_failed(error)
    formats = llma.quantization

    def what_fits(room: int) -> str:
        quantized = None if spec.quantization is not None or QUANT_NAMES.get(quant) else fitting_quant(
            lambda: transformer(args, ctx, stage), dtype, room)
        return "; ".join(filter(None, [quantized, fitting_stages(sizes(), room, args.n_layers, stages, tp)]))

    check_fits(llma, dtype, device, f"config of {folders[-1]}", what_fits)  # before any memory is allocated
    if device.type == "cpu":
        cpu_kernels()  # built once per machine (seconds), before anything is compiled
    llma.materialize(device, dtype)
    error = None
    try:
        load_weights(llma, folders, progress=ctx.is_source)
        if adapters:
            attach_adapters(llma, [(owner, read_adapter(path, args)) for owner, path in adapters])
    except Exception as e:  # every rank must hear of it, or the others would wait in the next collective
        error = e
    ctx.raise_if_any_failed(error)
    return_freed_memory()
    if device.type == "cpu":
        log.debug("%d MiB of weights on huge pages", back_with_huge_pages(llma) >> 20)
    log.info("loaded %s (%s%s) at %d model-parallel rank(s)%s, %s on %s%s", folders[-1], spec.llama_type,
             f", {describe(formats)}" if formats else "", ctx.world_size,
             f" ({stage.describe()} here)" if stages > 1 else "", dtype, device,
             f", PEFT adapter(s) {[str(path) for _, path in adapters]}" if adapters else "")
    return llma.eval()


def check_self_draft(spec: CheckpointSpec, quant, draft_quant, source: Path) -> None:
    """A quantized model drafting for itself in its own format would draft with its own weights as they are: as
    slow as itself, so it never pays (and its compiled steps could not be told from the target's)."""
    held = spec.quantization.quant if spec.quantization is not None else None
    target, draft = held or QUANT_NAMES.get(quant), held or QUANT_NAMES.get(draft_quant)
    if target is not None and target == draft:
        raise ConfigError(f'speculative_config {{"model": "self", "quant": {draft_quant!r}}}: the target {source} is '
                          f'held in {target} already, so its draft would be the same weights in the same format, as '
                          f'slow as the target; draft a float or int8 model with "quant": "int4", or draft with '
                          f'another checkpoint')


def check_draft_tokenizer(tokenizer: Tokenizer, folders: list[Path]) -> None:
    """A draft model must read and write the same token ids as its target: the same vocabulary, the same ids for
    the same text and the same special tokens."""
    draft = Tokenizer.from_path(found_tokenizer(folders))
    probe = "Speculative decoding: the draft's tokens are the target's. 12345 éà 漢字"
    if (draft.n_words, draft.encode(probe, bos=True, eos=True)) != (tokenizer.n_words,
                                                                   tokenizer.encode(probe, bos=True, eos=True)):
        raise ConfigError(f"speculative_config model {folders[-1]}: its tokenizer is not the target's (vocabulary "
                          f"{draft.n_words} vs {tokenizer.n_words}, or other ids for the same text); a draft model "
                          f"must share its target's tokenizer")


QUANT_NAMES = {True: "int8", "int8": "int8", "int4": "int4"}


def quantized_formats(llma, spec: CheckpointSpec, quant, source: Path) -> dict[str, str]:
    """Weight name -> format to hold the model's weights in: the checkpoint's own if it is quantized (`quant` may
    only name the same kind), else `quant`'s plan (empty for float)."""
    if quant not in (False, None) and quant not in QUANT_NAMES:
        raise ConfigError(f"quant must be False, True (int8), 'int8' or 'int4', got {quant!r}")
    wanted = QUANT_NAMES.get(quant)
    if spec.quantization is not None:
        if wanted is not None and wanted != spec.quantization.quant:
            raise ConfigError(f"{source} holds {spec.quantization.quant}-quantized weights; load it with quant="
                              f"{spec.quantization.quant!r} or without quant (requantizing is not supported)")
        return spec.quantization.tensors
    return llma.quantization_plan(wanted) if wanted else {}


def fitting_quant(build, dtype: torch.dtype, room: int) -> Optional[str]:
    """For a float checkpoint loaded unquantized, the `--quant` whose weights would fit `room` bytes a rank, for the
    refusal (`build()` makes this rank's network on the meta device); None if neither would."""
    for name in ("int8", "int4"):
        try:
            with torch.device("meta"):
                llma = build()
                llma.quantize_(llma.quantization_plan(name))
        except ConfigError:  # this rank's slices do not fall on whole groups
            continue
        need = weight_bytes(llma, dtype)
        if need <= room:
            return f"--quant {name} ({need / 2 ** 30:.2f} GiB of weights a rank) would fit"
    return None


def describe(formats: dict[str, str]) -> str:
    counts = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return "quantized weights: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))


def found_tokenizer(folders: list[Path]) -> Path:
    path = find_tokenizer(folders)
    if path is None:
        raise TokenizerError(f"no tokenizer.model or tokenizer.json in {[str(f) for f in folders]}; "
                             f"pass tokenizer_path")
    return path


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype
