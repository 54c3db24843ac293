"""MetaModel: the user-facing model, with LLaMA2-Accessory's API (`from_pretrained`, `generate`,
`stream_generate`) on a tensor-parallel model."""
from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from accessory.checkpoint.config import CheckpointSpec, read_spec, resolved_config
from accessory.checkpoint.direct import imported
from accessory.checkpoint.load import load_weights
from accessory.errors import AccessoryError, ConfigError, TokenizerError
from accessory.generation.chat import render_chat
from accessory.generation.engine import Engine, EngineSettings
from accessory.generation.sampling import SamplingParams
from accessory.generation.scheduler import Event, Request, fit_prompt, row_seeds
from accessory.network.LLM import model_classes
from accessory.network.memory import back_with_huge_pages, check_fits, return_freed_memory
from accessory.text.tokenizer import IMAGE_PLACEHOLDER, Tokenizer, find_tokenizer
from accessory.network.vision import ImagePlacement, optional_pixels
from accessory.parallel import ParallelContext, fairscale_model_parallel_group, init_distributed
from accessory.parallel.context import leave_at_exit
from accessory.parallel.watchdog import start_watchdog
from accessory.kernels import cpu_kernels

log = logging.getLogger(__name__)

PathLike = Union[str, Path]
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class MetaModel(nn.Module):
    def __init__(self, llma: nn.Module, tokenizer: Tokenizer, llama_type: str = "llama",
                 engine_settings: EngineSettings = EngineSettings()):
        super().__init__()
        self.llma, self.tokenizer, self.llama_type = llma, tokenizer, llama_type
        self.ctx: ParallelContext = llma.ctx
        # One stop-token set for every call: EOS, and the chat template's end-of-turn token if it has one.
        self.engine = Engine(llma, tokenizer, engine_settings, tokenizer.chat_stop_ids)

    @classmethod
    def from_pretrained(cls, pretrained_path: Union[PathLike, Sequence[PathLike]], llama_type: Optional[str] = None,
                        llama_config: Optional[Sequence[PathLike]] = None, tokenizer_path: Optional[PathLike] = None,
                        with_visual: bool = False, max_seq_len: int = 4096,
                        mp_group: Optional[torch.distributed.ProcessGroup] = None,
                        dtype: Union[None, str, torch.dtype] = None, device: Union[None, str, torch.device] = None,
                        quant: Union[bool, None, str] = False, *, max_batch_size: int = 32,
                        compile: bool = False, prefix_cache: bool = True,
                        prefix_cache_bytes: int = EngineSettings.prefix_cache_bytes,
                        rank_timeout: float = 60.0, warmup: bool = False) -> "MetaModel":
        """Load a checkpoint folder (or a list of folders, later ones overriding earlier ones) onto the
        model-parallel group `mp_group` (default: fairscale's model-parallel group if this process set one up, as
        LLaMA2-Accessory's scripts do with `initialize_model_parallel(n)`; else the torchrun world; else this
        process alone). A path may also be a llama.cpp `.gguf` file (its quantized bits kept) or a Hugging Face
        model folder: it is imported once into the cache, then loaded from there (checkpoint/direct.py).

        Every rank builds the model on the meta device and copies in only its own slice of each tensor, resharding
        from the checkpoint's shard count to the group's size. The config, tokenizer and parallel size are checked
        before any weight is read. Defaults: CUDA if available, else CPU; bfloat16 on CUDA, float32 on CPU.

        `quant`: weight-only quantization. True or "int8": every linear and the embedding in int8; "int4": the
        blocks' linears in int4, the embedding and output in int8. Each rank quantizes its own slice as it loads.
        A quantized checkpoint (`accessory quantize`, or a GGUF imported with its bits kept) loads in its own
        format whatever `quant` says, unless `quant` names another one. `max_batch_size` (rows decoded together),
        `compile` (torch.compile the decode step), `prefix_cache` (a prompt's start already in the KV cache is
        reused, not recomputed) and `prefix_cache_bytes` (per rank, for finished sequences kept to be reused) are
        the engine's settings (`model.engine`).

        `warmup` (with `compile`): compile every graph the engine will run before returning (`warm_up`), so no
        later call waits on compilation.

        `rank_timeout` (seconds; at more than one rank): a rank that stops answering (frozen, killed), or ranks
        that are no longer at the same generation step (user code that breaks out of a stream on some ranks only),
        end every rank with a named error within about this long, instead of a hang. A watchdog thread beats for
        each rank (`accessory.parallel.watchdog`); it ends the process when its rank cannot raise.

        `with_visual`: LLaMA2-Accessory's flag for a model that reads images. A vision-language checkpoint (llama_type
        "llava") loads its vision tower either way; with_visual=True on a text model is an error.
        """
        folders = [imported(Path(p)) for p in ([pretrained_path] if isinstance(pretrained_path, (str, Path))
                                               else pretrained_path)]
        settings = EngineSettings(max_batch_size=max_batch_size, compile=compile,  # checked before loading
                                  prefix_cache=prefix_cache, prefix_cache_bytes=prefix_cache_bytes)
        if mp_group is None:
            init_distributed()  # a script started by torchrun needs no set-up of its own
            mp_group = fairscale_model_parallel_group()
        if not (isinstance(rank_timeout, (int, float)) and rank_timeout > 0):
            raise ConfigError(f"rank_timeout must be a number of seconds > 0, got {rank_timeout!r}")
        ctx = ParallelContext.from_group(mp_group, rank_timeout)
        if ctx.world_size > 1:
            start_watchdog(rank_timeout)
            leave_at_exit(rank_timeout)
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)

        spec = read_spec(folders, llama_type, [str(p) for p in llama_config or ()])
        tokenizer = Tokenizer.from_path(tokenizer_path or _found_tokenizer(folders))
        model_args, transformer = model_classes(spec.llama_type)
        if with_visual and not hasattr(transformer, "image_features"):
            raise ConfigError(f"with_visual=True, but {folders[-1]} holds a text model (llama_type "
                              f"{spec.llama_type!r}); vision-language checkpoints are llama_type 'llava' (import an "
                              f"HF LLaVA folder with `accessory convert hf`)")
        config = resolved_config({**spec.config, "max_seq_len": max_seq_len}, tokenizer, str(folders[-1]))
        args = model_args.from_dict(config, source=f"config of {folders[-1]}")
        if tokenizer.n_words > args.vocab_size:
            raise ConfigError(f"tokenizer has {tokenizer.n_words} tokens but the model's vocab_size is "
                              f"{args.vocab_size}: they do not belong together")
        args.check_parallel_size(ctx.world_size)  # before any weight is read

        with torch.device("meta"):
            llma = transformer(args, ctx)
        formats = quantized_formats(llma, spec, quant, folders[-1])
        if formats:
            llma.quantize_(formats)
        check_fits(llma, dtype, device, f"config of {folders[-1]}")  # before any memory is allocated
        if device.type == "cpu":
            cpu_kernels()  # built once per machine (seconds), before anything is compiled
        llma.materialize(device, dtype)
        error = None
        try:
            load_weights(llma, folders, progress=ctx.is_source)
        except Exception as e:  # every rank must hear of it, or the others would wait in the next collective
            error = e
        ctx.raise_if_any_failed(error)
        return_freed_memory()
        if device.type == "cpu":
            log.debug("%d MiB of weights on huge pages", back_with_huge_pages(llma) >> 20)
        log.info("loaded %s (%s%s) at %d model-parallel rank(s), %s on %s", folders[-1], spec.llama_type,
                 f", {_describe(formats)}" if formats else "", ctx.world_size, dtype, device)
        model = cls(llma.eval(), tokenizer, spec.llama_type, settings)
        if warmup:
            model.warm_up()
        return model

    def warm_up(self) -> float:
        """With a compiled engine, compile every graph it runs (the decode step for one row, and for several rows
        with symbolic sizes) by decoding a few tokens at 1 and 2 rows, so that no later request waits on
        compilation; the seconds it took (0 without compile). Collective: every rank calls it. A compilation that
        fails is a ConfigError that says to run without compile."""
        if not self.engine.settings.compile:
            return 0.0
        start, stops = time.perf_counter(), self.stop_ids
        self.stop_ids = set()  # an early EOS would end a row before its decode steps
        try:
            for prompts in (["Hello"], ["Hello", "Hello there"]):
                self.generate(prompts, max_gen_len=3)
        except AccessoryError:
            raise
        except Exception as e:
            raise ConfigError(f"compiling the decode step failed ({type(e).__name__}: {str(e)[:500]}); run without "
                              f"--compile (compile=False)") from e
        finally:
            self.stop_ids = stops
        seconds = time.perf_counter() - start
        log.info("compiled the decode step in %.1f s", seconds)
        return seconds

    @property
    def stop_ids(self) -> set[int]:
        return self.engine.stop_ids

    @stop_ids.setter
    def stop_ids(self, ids) -> None:
        self.engine.stop_ids = set(ids)

    @property
    def max_batch_size(self) -> int:
        return self.engine.settings.max_batch_size

    # ---- generation -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], images=None, max_gen_len: int = 512, temperature: float = 0.0,
                 top_p: float = 0.95, additional_stop_symbols: Sequence[str] = (), seed: Optional[int] = None, *,
                 top_k: int = 0, repetition_penalty: float = 1.0, truncate: str = "left") -> list[str]:
        """Complete each prompt; every rank returns the same texts (the source rank's prompts and seed are used).

        `images` (a vision-language model): a tensor (prompts, C, S, S), or a list with one image (C, S, S) or None
        per prompt, each from `image_transform()`. An image fills the prompt's "<image>" placeholder, or follows BOS
        if it has none; its tokens count against max_seq_len and are never truncated.

        Stops on the tokenizer's end-of-sequence ids, the chat template's end-of-turn token, or any of
        `additional_stop_symbols` (cut from the text). `truncate`: what to do when a prompt plus max_gen_len exceeds
        max_seq_len: "left" keeps the prompt's end (with a warning), "error" raises ValueError.
        """
        if isinstance(prompts, str):
            raise ValueError("generate expects a list of prompts; for one prompt pass [prompt]")
        params = SamplingParams(max_gen_len, temperature, top_p, top_k, repetition_penalty)
        events = []
        for events in self._stream(prompts, images, params, additional_stop_symbols, seed, truncate):
            pass
        return [event.text for event in events]

    def stream_generate(self, prompt: Union[str, Sequence[str]], image=None, max_gen_len: int = 512,
                        temperature: float = 0.0, top_p: float = 0.95, additional_stop_symbols: Sequence[str] = (),
                        seed: Optional[int] = None, *, top_k: int = 0, repetition_penalty: float = 1.0,
                        truncate: str = "left") -> Iterator:
        """Stream one prompt as `Event`s (`event["text"]`: text so far, `["delta"]`: new text, `["end_of_content"]`),
        the last with end_of_content True; or a list of prompts as lists of Events, one per prompt, whenever any
        changes.

        Text that could still become a stop symbol, or is an incomplete UTF-8 character, is held back until clear.
        For a list of prompts, `additional_stop_symbols` may also be a list of lists: each prompt's own stops.
        Every rank yields the same events (each detokenizes the tokens it already has), so user code that every
        rank runs may stop reading at any point (`break`): that ends the generation on every rank alike. `image`:
        the prompt's image (C, S, S) or (1, C, S, S), or for a list of prompts what `generate` takes as `images`.
        """
        params = SamplingParams(max_gen_len, temperature, top_p, top_k, repetition_penalty)
        batch = not isinstance(prompt, str)
        images = image if batch or image is None else [image]
        yield from _changed_events(self._stream(list(prompt) if batch else [prompt], images, params,
                                                additional_stop_symbols, seed, truncate), batch)

    def chat(self, messages: list[dict], max_gen_len: int = 512, temperature: float = 0.0, top_p: float = 0.95,
             seed: Optional[int] = None, *, template: Optional[str] = None, **options) -> str:
        """The assistant's reply to OpenAI-style messages ([{"role": "system"|"user"|"assistant", "content"}]).

        `template`: None uses the model's own chat template (or LLaMA2-Accessory's default conversation if it has
        none); a name from `accessory.data.conversation.conv_templates` uses that one, with its stop symbols.
        `image=` (a vision-language model): the conversation's image; it goes where a message's content says
        "<image>", or after BOS.
        """
        text = ""
        for event in self.stream_chat(messages, max_gen_len, temperature, top_p, seed, template=template, **options):
            text = event.text
        return text

    def stream_chat(self, messages: list[dict], max_gen_len: int = 512, temperature: float = 0.0, top_p: float = 0.95,
                    seed: Optional[int] = None, *, template: Optional[str] = None,
                    additional_stop_symbols: Sequence[str] = (), image=None, **options) -> Iterator[Event]:
        """`chat`, streamed as `stream_generate` streams one prompt."""
        prompt, stops = render_chat(self.tokenizer, messages, template)
        yield from self.stream_generate(prompt, image, max_gen_len, temperature, top_p,
                                        [*stops, *additional_stop_symbols], seed, **options)

    def _stream(self, prompts: list[str], images, params: SamplingParams, stop_strings, seed, truncate):
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        images = self.checked_images(images, len(prompts))
        # The source rank's prompts, images and seed win, so ranks cannot disagree even if their callers do.
        prompts, images, seed = self.ctx.broadcast_object(
            (list(prompts), images, secrets.randbits(63) if seed is None else seed))
        stops = _stops_per_prompt(stop_strings, len(prompts))
        requests = []
        for row, (prompt, image, row_seed) in enumerate(zip(prompts, images, row_seeds(seed, len(prompts)))):
            tokens = self.encode_prompt(prompt, image is not None)
            if image is not None:
                self._check_room(tokens, params, row)  # an image is never cut: its prompt must fit whole
            tokens = fit_prompt(tokens, params, self.llma.args.max_seq_len, truncate, row)
            if not tokens:
                raise ValueError(f"prompt {row} is empty after tokenization")
            requests.append(Request(row, tokens, params, row_seed, stops[row], image=image))
        yield from self.engine.stream(requests)

    # ---- images -----------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, image: bool = False, special: bool = True) -> list[int]:
        """The prompt's token ids, BOS first. With an image (a vision-language model), its `image_tokens` image
        tokens stand where the prompt's "<image>" placeholder is (the tokenizer's own token, or text that LLaVA's
        code splits the prompt at), or right after BOS if it has none, as LLaMA2-Accessory places visual tokens.
        `special=False`: special tokens' text is plain text."""
        ids = self.tokenizer.encode(prompt, bos=True, eos=False, special=special)
        llma = self.llma
        if not image:
            if llma.image_tokens and (llma.image_token in ids or IMAGE_PLACEHOLDER in prompt):
                raise ValueError(f"the prompt holds the image placeholder {IMAGE_PLACEHOLDER!r} but no image was "
                                 f"given")
            return ids
        if not llma.image_tokens:
            raise ValueError(f"an image was given, but this model ({self.llama_type}) reads text only")
        image_ids = [llma.image_token] * llma.image_tokens
        if llma.image_token in ids or IMAGE_PLACEHOLDER not in prompt:
            if ids.count(llma.image_token) > 1:
                raise ValueError(f"the prompt holds {ids.count(llma.image_token)} image placeholders; it takes one "
                                 f"image")
            at = ids.index(llma.image_token) if llma.image_token in ids else int(ids[:1] == [self.tokenizer.bos_id])
            return ids[:at] + image_ids + ids[at + (llma.image_token in ids):]
        pieces = self.tokenizer.encode_pieces(prompt, IMAGE_PLACEHOLDER, bos=True, special=special)
        if len(pieces) > 2:
            raise ValueError(f"the prompt holds {len(pieces) - 1} {IMAGE_PLACEHOLDER!r} placeholders; it takes one "
                             f"image")
        return pieces[0] + image_ids + pieces[1]

    def image_transform(self, name: str = "padded_resize"):
        """PIL image -> pixels for this model: `accessory.data.transform.get_transform(name, image_size)` with the
        model's own normalisation. "padded_resize" (default) pads to a square first, as LLaVA-1.5 was trained;
        "resized_center_crop" crops the middle square."""
        from accessory.data.transform import get_transform

        if not self.llma.image_tokens:
            raise ValueError(f"this model ({self.llama_type}) reads text only: it has no image transform")
        args = self.llma.args
        return get_transform(name, self.llma.image_size, mean=tuple(args.image_mean), std=tuple(args.image_std))

    def checked_images(self, images, count: int) -> list:
        """`images` as one entry per prompt (pixels or None), checked against the model."""
        if images is None:
            return [None] * count
        if not self.llma.image_tokens:
            raise ValueError(f"images were given, but this model ({self.llama_type}) reads text only: a "
                             f"vision-language checkpoint (llama_type 'llava') reads images")
        channels = self.llma.args.vision["num_channels"]
        return optional_pixels(images, count, channels, self.llma.image_size, "images")

    def _check_room(self, tokens: list[int], params: SamplingParams, row: int) -> None:
        room = self.llma.args.max_seq_len - params.max_gen_len
        if len(tokens) > room:
            raise ValueError(f"prompt {row} with its image is {len(tokens)} tokens ({self.llma.image_tokens} of them "
                             f"the image's); with max_gen_len {params.max_gen_len} at most {room} fit in max_seq_len "
                             f"{self.llma.args.max_seq_len}, and a prompt with an image is never truncated")

    # ---- scoring ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def compute_logits(self, examples: Sequence[Union[str, list[int]]], images=None, bos: bool = True,
                       eos: bool = False) -> list[torch.Tensor]:
        """Float32 logits (len_i, vocab) for every position of each example (text, or token ids). `images` as
        `generate` takes them: a text example's image goes where `encode_prompt` puts it; a token-id example must
        already hold its `image_tokens` image tokens."""
        images = self.ctx.broadcast_object(self.checked_images(images, len(examples)) if images is not None else None)
        return self._logits(self._tokenized(examples, bos, eos, images), images)

    def _logits(self, examples: list[list[int]], images: Optional[list]) -> list[torch.Tensor]:
        """`compute_logits` of token ids (each rank's alike) and their checked images (or None)."""
        images = images or [None] * len(examples)
        logits = []
        for start in range(0, len(examples), self.max_batch_size):
            wave = examples[start: start + self.max_batch_size]
            # right padding: causal attention never lets a real token see the padding after it
            tokens = torch.zeros(len(wave), max(map(len, wave)), dtype=torch.long, device=self.llma.device)
            for row, ids in enumerate(wave):
                tokens[row, :len(ids)] = torch.tensor(ids)
            placements = [ImagePlacement(row, 0, len(ids), image)
                          for row, (ids, image) in enumerate(zip(wave, images[start:])) if image is not None]
            out = self.llma(tokens, placements)
            logits += [out[row, :len(ids)] for row, ids in enumerate(wave)]
        return logits

    @torch.inference_mode()
    def evaluate_examples(self, examples: Sequence[Union[str, list[int]]],
                          contexts: Optional[Sequence[Union[str, list[int]]]] = None, images=None, bos: bool = True,
                          eos: bool = False) -> dict[str, list]:
        """LLaMA2-Accessory's metrics of each example's tokens after its context (all but the first if none).

        Returns lists, one item per example: "log_likelihood" (sum of token log-probs), "ppl" (mean negative
        log-likelihood per token, LLaMA2-Accessory's name for it), "perplexity" (exp of that), "max_equal" (greedy
        decoding reproduces every token), "non_context_logits" (the logits that predict those tokens).
        """
        images = self.ctx.broadcast_object(self.checked_images(images, len(examples)) if images is not None else None)
        tokens = self._tokenized(examples, bos, eos, images)
        context_tokens = self._tokenized(contexts, bos, False, images) if contexts is not None else None
        if context_tokens is not None:
            if len(context_tokens) != len(tokens):
                raise ValueError(f"{len(tokens)} examples but {len(context_tokens)} contexts")
            for i, (example, context) in enumerate(zip(tokens, context_tokens)):
                if example[:len(context)] != context or not context:
                    raise ValueError(f"context {i} is empty or is not the start of example {i} once tokenized")
        result = {"log_likelihood": [], "ppl": [], "perplexity": [], "max_equal": [], "non_context_logits": []}
        for i, logits in enumerate(self._logits(tokens, images)):
            start = len(context_tokens[i]) - 1 if context_tokens is not None else 0
            predicting = logits[start:-1]
            labels = torch.tensor(tokens[i][start + 1:], device=logits.device)
            nll = torch.nn.functional.cross_entropy(predicting, labels, reduction="none")
            result["log_likelihood"].append(-nll.sum().item())
            result["ppl"].append(nll.mean().item())
            result["perplexity"].append(nll.mean().exp().item())
            result["max_equal"].append(bool((predicting.argmax(-1) == labels).all()))
            result["non_context_logits"].append(predicting)
        return result

    @torch.inference_mode()
    def next_token_probs(self, prompt: str, top_k: int = 10, temperature: float = 1.0) -> list[tuple[str, float, int]]:
        """The `top_k` likeliest next tokens after `prompt`: [(token_text, probability, token_id), ...], most likely
        first, probabilities from softmax(logits / temperature) over the whole vocabulary."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k!r}")
        [logits] = self.compute_logits([prompt])
        probs = torch.softmax(logits[-1] / temperature, dim=-1)
        values, ids = probs.topk(min(top_k, probs.numel()))
        return [(self.tokenizer.decode([i]), p, i) for p, i in zip(values.tolist(), ids.tolist())]

    def _tokenized(self, examples, bos: bool, eos: bool, images=None) -> list[list[int]]:
        if isinstance(examples, str) or not examples:
            raise ValueError("examples must be a non-empty list of texts or token-id lists")
        examples = self.ctx.broadcast_object(list(examples))
        images = images or [None] * len(examples)
        tokens = [(self._encoded_example(e, bos, eos, image is not None) if isinstance(e, str) else list(e))
                  for e, image in zip(examples, images)]
        for i, (ids, image) in enumerate(zip(tokens, images)):
            held, wanted = ids.count(self.llma.image_token), self.llma.image_tokens if image is not None else 0
            if self.llma.image_tokens and held != wanted:
                raise ValueError(f"example {i} holds {held} image tokens ({self.llma.image_token}); with "
                                 f"{'its' if image is not None else 'no'} image it must hold {wanted}")
        for i, ids in enumerate(tokens):
            if not 0 < len(ids) <= self.llma.args.max_seq_len:
                raise ValueError(f"example {i} has {len(ids)} tokens; scoring needs 1 to max_seq_len "
                                 f"({self.llma.args.max_seq_len})")
        return tokens

    def _encoded_example(self, text: str, bos: bool, eos: bool, image: bool) -> list[int]:
        if not image:
            return self.tokenizer.encode(text, bos, eos)
        ids = self.encode_prompt(text, image=True)
        return (ids if bos else ids[1:]) + ([self.tokenizer.eos_id] if eos else [])


def _stops_per_prompt(stop_strings, n: int) -> list[list[str]]:
    """One list of stop strings for every prompt, or a list of lists (one per prompt), as n lists."""
    stop_strings = list(stop_strings)
    if stop_strings and all(isinstance(s, (list, tuple)) for s in stop_strings):
        if len(stop_strings) != n:
            raise ValueError(f"{len(stop_strings)} lists of stop symbols for {n} prompts; give one per prompt")
        return [list(s) for s in stop_strings]
    if any(not isinstance(s, str) for s in stop_strings):
        raise ValueError("additional_stop_symbols must be strings, or one list of strings per prompt")
    return [stop_strings] * n


def _changed_events(steps, batch: bool):
    """The events of a single prompt as they change (ending with end_of_content), or batch steps that changed."""
    ended = None
    for events in steps:
        now = [e.end_of_content for e in events]
        if any(e.delta for e in events) or now != ended:
            yield list(events) if batch else events[0]
        ended = now


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


def _describe(formats: dict[str, str]) -> str:
    counts = {}
    for fmt in formats.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return "quantized weights: " + ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))


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
