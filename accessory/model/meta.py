"""MetaModel: the user-facing model, with LLaMA2-Accessory's API (`from_pretrained`, `generate`,
`stream_generate`) on a tensor-parallel model."""
from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from accessory.checkpoint.config import read_spec
from accessory.checkpoint.load import load_weights
from accessory.errors import ConfigError, TokenizerError
from accessory.generation.engine import decode_steps
from accessory.generation.text import RowText
from accessory.model.LLM import model_classes
from accessory.model.tokenizer import Tokenizer, find_tokenizer
from accessory.parallel import ParallelContext, init_distributed

log = logging.getLogger(__name__)

PathLike = Union[str, Path]
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class MetaModel(nn.Module):
    def __init__(self, llma: nn.Module, tokenizer: Tokenizer, llama_type: str = "llama"):
        super().__init__()
        self.llma, self.tokenizer, self.llama_type = llma, tokenizer, llama_type
        self.ctx: ParallelContext = llma.ctx
        # One stop-token set for every call: EOS, and the chat template's end-of-turn token if it has one.
        self.stop_ids = set(tokenizer.eos_ids) | (tokenizer.chat_stop_ids if tokenizer.has_chat_template else set())

    @classmethod
    def from_pretrained(cls, pretrained_path: Union[PathLike, Sequence[PathLike]], llama_type: Optional[str] = None,
                        llama_config: Optional[Sequence[PathLike]] = None, tokenizer_path: Optional[PathLike] = None,
                        with_visual: bool = False, max_seq_len: int = 4096,
                        mp_group: Optional[torch.distributed.ProcessGroup] = None,
                        dtype: Union[None, str, torch.dtype] = None, device: Union[None, str, torch.device] = None,
                        quant: bool = False) -> "MetaModel":
        """Load a checkpoint folder (or a list of folders, later ones overriding earlier ones) onto the
        model-parallel group `mp_group` (default: the torchrun world, or this process alone).

        Every rank builds the model on the meta device and copies in only its own slice of each tensor, resharding
        from the checkpoint's shard count to the group's size. The config, tokenizer and parallel size are checked
        before any weight is read. Defaults: CUDA if available, else CPU; bfloat16 on CUDA, float32 on CPU.
        """
        if with_visual:
            raise NotImplementedError("with_visual=True: multimodal llama types are not built yet")
        if quant:
            raise NotImplementedError("quant=True: quantized loading is not built yet")
        folders = [Path(p) for p in ([pretrained_path] if isinstance(pretrained_path, (str, Path))
                                     else pretrained_path)]
        if mp_group is None:
            init_distributed()  # a script started by torchrun needs no set-up of its own
        ctx = ParallelContext.from_group(mp_group)
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)

        spec = read_spec(folders, llama_type, [str(p) for p in llama_config or ()])
        tokenizer = Tokenizer.from_path(tokenizer_path or _found_tokenizer(folders))
        model_args, transformer = model_classes(spec.llama_type)
        config = {**spec.config, "max_seq_len": max_seq_len}
        if config.get("vocab_size", -1) <= 0:
            config["vocab_size"] = tokenizer.n_words
        args = model_args.from_dict(config, source=f"config of {folders[-1]}")
        if tokenizer.n_words > args.vocab_size:
            raise ConfigError(f"tokenizer has {tokenizer.n_words} tokens but the model's vocab_size is "
                              f"{args.vocab_size}: they do not belong together")
        args.check_parallel_size(ctx.world_size)  # before any weight is read

        with torch.device("meta"):
            llma = transformer(args, ctx)
        llma.materialize(device, dtype)
        error = None
        try:
            load_weights(llma, folders, progress=ctx.is_source)
        except Exception as e:  # every rank must hear of it, or the others would wait in the next collective
            error = e
        ctx.raise_if_any_failed(error)
        log.info("loaded %s (%s) at %d model-parallel rank(s), %s on %s", folders[-1], spec.llama_type,
                 ctx.world_size, dtype, device)
        return cls(llma.eval(), tokenizer, spec.llama_type)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str], images=None, max_gen_len: int = 512, temperature: float = 0.0,
                 top_p: float = 0.95, additional_stop_symbols: Sequence[str] = (),
                 seed: Optional[int] = None) -> list[str]:
        """Complete each prompt; every rank returns the same texts (the source rank's prompts are used)."""
        rows = [RowText(self.tokenizer, additional_stop_symbols) for _ in prompts]
        for _ in self._steps(list(prompts), rows, images, max_gen_len, temperature, top_p, seed):
            pass
        return [row.text for row in rows]

    @torch.inference_mode()
    def stream_generate(self, prompt: str, image=None, max_gen_len: int = 512, temperature: float = 0.0,
                        top_p: float = 0.95, additional_stop_symbols: Sequence[str] = (),
                        seed: Optional[int] = None) -> Iterator[dict]:
        """Yield {"text": text so far, "end_of_content": False} as text settles, then the whole text with True.

        Text that could still turn into a stop string is held back until it cannot.
        """
        row = RowText(self.tokenizer, additional_stop_symbols)
        shown = ""
        for _ in self._steps([prompt], [row], image, max_gen_len, temperature, top_p, seed):
            if row.visible != shown and not row.stopped:
                shown = row.visible
                yield {"text": shown, "end_of_content": False}
        yield {"text": row.text, "end_of_content": True}

    def _steps(self, prompts: list[str], rows: list[RowText], images, max_gen_len, temperature, top_p, seed):
        if images is not None:
            raise NotImplementedError("images: multimodal llama types are not built yet")
        # The source rank's prompts and seed win, so ranks cannot disagree even if their callers do.
        prompts, seed = self.ctx.broadcast_object((prompts, secrets.randbits(63) if seed is None else seed))
        tokens = [self.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
        stopped = [False] * len(rows)
        for step in decode_steps(self.llma, tokens, max_gen_len, temperature, top_p, seed, self.stop_ids, stopped):
            for row, token in zip(rows, step):
                if token is not None:
                    row.push(token)
            for i, row in enumerate(rows):
                stopped[i] = stopped[i] or row.stopped
            yield
        for row in rows:
            row.finish()


def _found_tokenizer(folders: list[Path]) -> Path:
    path = find_tokenizer(folders)
    if path is None:
        raise TokenizerError(f"no tokenizer.model or tokenizer.json in {[str(f) for f in folders]}; "
                             f"pass tokenizer_path")
    return path


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype
