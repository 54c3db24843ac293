"""`accessory inspect PATH`: what a checkpoint is, and whether every shard of it would load.

Facts: format, shard files, dtypes, parameter count, llama_type, config, tokenizer; for a mixture of experts, the
experts each shard holds and (`ranks`) where they would live at that many ranks. Checks, all collected rather
than stopping at the first: every shard readable, the same tensors in every shard, each tensor's pieces assembling
into the model's shape along one split dimension (the loader's own rule, load.py `split_dim`), and no tensor
missing or unexpected for the llama_type and config. A problem is one line naming the file, key and expectation.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from accessory.errors import AccessoryError, listing

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
FORMAT_NAMES = {"accessory": "accessory (LLaMA2-Accessory shards)", "meta": "meta (Meta's original release)",
                "hf": "hf (Hugging Face LlamaForCausalLM)", "gguf": "gguf (llama.cpp)",
                "dcp": "dcp (torch.distributed.checkpoint)"}


@dataclass
class Report:
    path: str
    format: Optional[str] = None
    files: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    parameters: Optional[int] = None
    quantization: Optional[str] = None  # "int8", "int4" or "mixed" for a quantized checkpoint
    llama_type: Optional[str] = None
    config: dict = field(default_factory=dict)
    tokenizer: Optional[dict] = None
    # a mixture of experts: {"num_experts", "per_token", "shards": [one line per shard file], "ranks": [one line per
    # rank, when asked for a rank count]}
    experts: Optional[dict] = None
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shards": len(self.files), "healthy": not self.problems}


def inspect_checkpoint(path: Path, ranks: Optional[int] = None) -> Report:
    """A Report on `path`; never raises for a bad checkpoint (its problems are in `Report.problems`). `ranks`: also
    say which experts each of that many ranks would hold (a mixture of experts)."""
    path = Path(path)
    report = Report(str(path))
    if not path.exists():
        report.problems.append(f"{path}: does not exist")
    elif path.is_file():
        _guarded(report, _inspect_gguf if path.suffix == ".gguf" else _not_a_checkpoint, path)
    elif (path / ".metadata").is_file():
        _guarded(report, _inspect_dcp, path)
    elif any((path / name).is_file() for name in HF_WEIGHT_FILES):
        _guarded(report, _inspect_hf, path)
    else:
        _guarded(report, _inspect_shards, path)
    _describe_placement(report, ranks)
    return report


def _guarded(report: Report, step, *args) -> None:
    try:
        step(report, *args)
    except AccessoryError as e:  # bad input stops this step; what was found so far is still reported
        report.problems.append(str(e))


def _not_a_checkpoint(report: Report, path: Path) -> None:
    report.problems.append(f"{path}: a file, but not a .gguf one; expected a checkpoint folder or a .gguf file")


# ---- accessory / Meta shard folders ----------------------------------------------------------------------------

def _inspect_shards(report: Report, folder: Path) -> None:
    from accessory.checkpoint.shard_files import find_shards, read_shard

    shards = find_shards(folder)
    report.format, report.files = shards.kind, [p.name for p in shards.files]
    opened = {}
    for path in shards.files:
        try:
            opened[path] = read_shard(path, shards.kind)
        except AccessoryError as e:
            report.problems.append(str(e))
    _check_same_keys(report, opened)
    shapes = _describe_model(report, [folder])
    if shapes is None or len(opened) != len(shards.files):
        return  # without the model's shapes, or with a shard unreadable, assembling cannot be checked
    _check_pieces(report, folder, list(opened.values()), shapes)
    if report.config.get("moe"):
        report.experts = {}
        report.experts["shards"] = [f"{path.name}: {_held_experts(tensors, shapes)}" for path, tensors in
                                    opened.items()]


def _check_same_keys(report: Report, opened: dict) -> None:
    """Every shard holds the same tensors, except a mixture's experts (each in the shards its expert is on)."""
    from accessory.checkpoint.load import EXPERT_KEY

    if not opened:
        return
    first_path, first = next(iter(opened.items()))
    for path, tensors in opened.items():
        missing = sorted(k for k in first.keys() - tensors.keys() if not EXPERT_KEY.search(k))
        extra = sorted(k for k in tensors.keys() - first.keys() if not EXPERT_KEY.search(k))
        if missing or extra:
            report.problems.append(f"{path}: holds other tensors than {first_path.name}: missing "
                                   f"[{listing(missing)}], extra [{listing(extra)}]")


def _check_pieces(report: Report, folder: Path, opened: list[dict], shapes: dict) -> None:
    from accessory.checkpoint.load import EXPERT_KEY, key_mismatch, split_dim

    found = set().union(*(t.keys() for t in opened))
    if problem := key_mismatch(found, shapes.keys()):
        report.problems.append(f"{folder}: {problem}")
    dtypes = set()
    for key, shape in shapes.items():
        pieces = [t[key] for t in opened if key in t]
        if not pieces or (len(pieces) != len(opened) and not EXPERT_KEY.search(key)):
            continue  # reported above as a missing key
        dtypes |= {str(p.dtype).removeprefix("torch.") for p in pieces}
        try:
            split_dim(pieces, list(shape), f"{folder}: tensor {key!r}")
        except AccessoryError as e:
            report.problems.append(str(e))
    report.dtypes = sorted(dtypes)


def _describe_model(report: Report, folders: list[Path], tokenizer_path=None) -> Optional[dict]:
    """Fill llama_type, config and tokenizer from the files beside the weights; the model's key -> full shape."""
    from accessory.checkpoint.config import read_spec, resolved_config
    from accessory.checkpoint.importers.shards import model_layout
    from accessory.text.tokenizer import find_tokenizer_for

    tokenizer = None
    try:
        tokenizer = find_tokenizer_for(folders, tokenizer_path)
        if tokenizer is None:
            report.problems.append(f"{folders[-1]}: no tokenizer.model or tokenizer.json beside the weights")
        else:
            report.tokenizer = _tokenizer_facts(tokenizer)
    except AccessoryError as e:  # an unreadable tokenizer file
        report.problems.append(str(e))
    try:
        spec = read_spec(folders)
        report.llama_type, report.config = spec.llama_type, dict(spec.config)
        config = resolved_config(spec.config, tokenizer, str(folders[-1]))
        formats = spec.quantization.tensors if spec.quantization else None
        report.quantization = spec.quantization.quant if spec.quantization else None
        shapes = model_layout(spec.llama_type, config, f"config of {folders[-1]}", formats)
        report.parameters = sum(math.prod(shape) for shape in model_layout(spec.llama_type, config, "").values())
    except AccessoryError as e:
        report.problems.append(str(e))
        return None
    report.config = config
    if tokenizer is not None and tokenizer.n_words > config["vocab_size"]:
        report.problems.append(f"{folders[-1]}: tokenizer has {tokenizer.n_words} tokens but vocab_size is "
                               f"{config['vocab_size']}")
    return shapes


def _held_experts(tensors: dict, shapes: dict) -> str:
    """The experts a shard holds, as ranges of global ids, each whole or a slice of its hidden units."""
    from accessory.checkpoint.load import EXPERT_KEY

    ids = sorted({int(m.group(0).split(".")[2]) for key in tensors if (m := EXPERT_KEY.search(key))})
    if not ids:
        return "no experts"
    w1 = next(k for k in tensors if ".experts." in k and k.endswith(".w1.weight"))
    hidden, full = tensors[w1].shape[0], shapes[w1][0]
    return f"experts {_ranges(ids)}, " + ("whole" if hidden == full else f"{hidden} of {full} hidden units each")


def _describe_placement(report: Report, ranks: Optional[int]) -> None:
    """Where the experts would live at `ranks` ranks (parallel/layers.py `expert_placement`, the loader's rule)."""
    moe = (report.config or {}).get("moe")
    if not moe:
        return
    from accessory.parallel.layers import expert_placement

    experts = report.experts or {}
    report.experts = {"num_experts": moe["num_experts"], "per_token": moe["num_experts_per_tok"],
                      "shards": experts.get("shards", []), "ranks": []}
    for rank in range(ranks or 0):
        place = expert_placement(moe["num_experts"], ranks, rank)
        where = "whole" if place.parts == 1 else f"hidden-unit slice {place.part + 1} of {place.parts}"
        report.experts["ranks"].append(f"rank {rank}: experts {_ranges(list(place.experts))}, {where}")


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ids[0]
    for previous, current in zip(ids, ids[1:] + [None]):
        if current != previous + 1:
            out.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(out)


def _tokenizer_facts(tokenizer) -> dict:
    kind = "sentencepiece" if tokenizer.path.suffix == ".model" else "tokenizers (tokenizer.json)"
    return {"file": tokenizer.path.name, "kind": kind, "vocab_size": tokenizer.n_words,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "chat_template": tokenizer.has_chat_template}


# ---- HF, DCP, GGUF ---------------------------------------------------------------------------------------------

def _inspect_hf(report: Report, folder: Path) -> None:
    """An HF folder is checked by importing it (names, tied head, shapes against config.json)."""
    from accessory.checkpoint.importers import read_hf

    report.format = "hf"
    report.files = sorted(p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".bin")))
    imported = read_hf(folder)
    _fill_from_import(report, imported, folder)


def _inspect_dcp(report: Report, folder: Path) -> None:
    """A DCP folder: every data file the metadata points into is there and long enough, and the tensors under
    the model's prefix are exactly the model's, in its shapes."""
    from accessory.checkpoint.importers.dcp import model_prefix, read_dcp_metadata, tensor_entries
    from accessory.checkpoint.load import key_mismatch

    report.format = "dcp"
    metadata = read_dcp_metadata(folder)
    report.files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    for name in report.files:
        ends = [i.offset + i.length for i in metadata.storage_data.values() if i.relative_path == name]
        size = (folder / name).stat().st_size if (folder / name).is_file() else None
        if size is None or size < max(ends):
            report.problems.append(f"{folder / name}: {'missing' if size is None else f'{size} bytes'}; the "
                                   f"metadata reads up to byte {max(ends)} of it (truncated?)")
    entries = tensor_entries(metadata)
    report.dtypes = sorted({str(m.properties.dtype).removeprefix("torch.") for m in entries.values()})
    shapes = _describe_model(report, [folder])
    if shapes is None:
        return
    prefix = model_prefix(entries.keys(), folder)
    ours = {k[len(prefix):]: tuple(m.size) for k, m in entries.items() if k.startswith(prefix)}
    if problem := key_mismatch(ours.keys(), shapes.keys()):
        report.problems.append(f"{folder}: {problem}")
    report.problems += [f"{folder}: tensor {prefix + k!r} has shape {ours[k]}, the model's is {s}"
                        for k, s in shapes.items() if k in ours and ours[k] != s]
    report.parameters = sum(math.prod(shape) for shape in shapes.values())


def _inspect_gguf(report: Report, path: Path) -> None:
    """A GGUF file is checked by importing it (metadata, names, shapes), which dequantizes every tensor."""
    import tempfile

    from accessory.checkpoint.importers import read_gguf
    from accessory.checkpoint.importers.gguf import open_gguf

    report.format, report.files = "gguf", [path.name]
    stored = sorted({t.tensor_type.name for t in open_gguf(path).tensors})  # checked before it is read
    with tempfile.TemporaryDirectory(prefix="accessory-inspect-") as work:
        _fill_from_import(report, read_gguf(path, Path(work)), Path(work))
    report.dtypes = stored  # the stored (quantized) types, not the dequantized float32


def _fill_from_import(report: Report, imported, tokenizer_folder: Path) -> None:
    from accessory.text.tokenizer import Tokenizer, find_tokenizer

    report.llama_type, report.config = imported.llama_type, imported.config
    dtypes, report.parameters = set(), 0
    for tensor in imported.state_dict.values():  # each read once: a GGUF's are dequantized as they are read
        dtypes.add(str(tensor.dtype).removeprefix("torch."))
        report.parameters += tensor.numel()
    report.dtypes = sorted(dtypes)
    tokenizer = find_tokenizer([tokenizer_folder])
    if tokenizer is None:
        report.problems.append(f"{tokenizer_folder}: no tokenizer.model or tokenizer.json")
    else:
        report.tokenizer = _tokenizer_facts(Tokenizer.from_path(tokenizer))


# ---- text ------------------------------------------------------------------------------------------------------

def format_report(report: Report) -> str:
    lines = [f"path:        {report.path}",
             f"format:      {FORMAT_NAMES.get(report.format, report.format or 'unknown')}",
             f"shards:      {len(report.files)}" + (f" ({', '.join(report.files)})" if report.files else ""),
             f"dtype:       {', '.join(report.dtypes) or 'unknown'}",
             f"parameters:  {report.parameters:,}" if report.parameters is not None else "parameters:  unknown",
             f"llama_type:  {report.llama_type or 'unknown'}"]
    if report.quantization:
        lines.append(f"quantized:   {report.quantization} (weight-only, groups of 32; see meta.json)")
    if report.tokenizer:
        t = report.tokenizer
        lines.append(f"tokenizer:   {t['file']} ({t['kind']}), {t['vocab_size']} tokens, bos {t['bos_id']}, "
                     f"eos {t['eos_id']}, chat template: {'yes' if t['chat_template'] else 'no'}")
    else:
        lines.append("tokenizer:   none found")
    if report.experts:
        e = report.experts
        lines.append(f"experts:     {e['num_experts']}, {e['per_token']} per token")
        lines += [f"  {line}" for line in e["shards"] + e["ranks"]]
    lines.append("config:")
    lines += [f"  {k}: {v}" for k, v in report.config.items()]
    if report.problems:
        lines.append(f"PROBLEMS ({len(report.problems)}):")
        lines += [f"  - {p}" for p in report.problems]
    else:
        lines.append("integrity:   OK (every shard readable, shapes consistent, no missing or unexpected keys)")
    return "\n".join(lines)
