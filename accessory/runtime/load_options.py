"""How a model is loaded (LoadOptions): `MetaModel.from_pretrained`'s keywords as one value, which the command line
builds from its flags and the loader reads. Torch-free, so the command line's parser can take its defaults
(`LoadOptions.max_seq_len`) without importing torch."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

if TYPE_CHECKING:
    import torch

PathLike = Union[str, Path]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """`MetaModel.from_pretrained`'s arguments but `warmup` (which runs once the model is loaded); its docstring
    says what each means, and its signature carries these defaults (tests/runtime/test_load_options.py holds them
    equal)."""
    pretrained_path: Union[PathLike, Sequence[PathLike]]
    llama_type: Optional[str] = None
    llama_config: Optional[Sequence[PathLike]] = None
    tokenizer_path: Optional[PathLike] = None
    with_visual: bool = False
    max_seq_len: int = 4096
    mp_group: Optional["torch.distributed.ProcessGroup"] = None
    pipeline_parallel_size: int = 1
    pipeline_layers: Optional[str] = None  # "even" (None), "auto", or a count per stage: "12,18"
    dtype: Union[None, str, "torch.dtype"] = None
    device: Union[None, str, "torch.device"] = None
    quant: Union[bool, None, str] = False
    max_batch_size: Union[int, str] = 32  # or "auto" (generation/batch_size.py)
    compile: bool = False
    prefix_cache: bool = True
    prefix_cache_bytes: int = 256 << 20  # EngineSettings' default (tests/runtime/test_load_options.py holds them equal)
    rank_timeout: float = 60.0
    speculative_config: Optional[dict] = None
    lora: Optional[PathLike] = None
    lora_modules: Optional[dict[str, PathLike]] = None
    exact_products: bool = False

