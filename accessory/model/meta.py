"""MetaModel: the user-facing model, with LLaMA2-Accessory's API (`from_pretrained`, `generate`,
`stream_generate`) on a tensor-parallel model. A thin face over the runtime layer: loading (runtime/loading.py),
prompts and their images (runtime/prompts.py), scoring (runtime/scoring.py), and the engine that generates
(generation/engine.py)."""
from __future__ import annotations

import logging
import time
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from accessory.errors import AccessoryError, ConfigError
from accessory.generation.chat import ChatReply, read_reply, render_chat
from accessory.generation.engine import Engine, EngineSettings
from accessory.generation.sampling import SamplingParams
from accessory.generation.requests import Event
from accessory.parallel import ParallelContext
from accessory.runtime import prompts, scoring
from accessory.runtime.load_options import LoadOptions, PathLike
from accessory.runtime.loading import load
from accessory.text.reasoning import opens_reasoning, reasoning_format
from accessory.text.tokenizer import Tokenizer
from accessory.text.tool_calls import ToolReading, call_format

log = logging.getLogger(__name__)


class MetaModel(nn.Module):
    def __init__(self, llma: nn.Module, tokenizer: Tokenizer, llama_type: str = "llama",
                 engine_settings: EngineSettings = EngineSettings(), draft: Optional[nn.Module] = None,
                 adapter_names: Sequence[str] = ()):
        super().__init__()
        self.llma, self.tokenizer, self.llama_type = llma, tokenizer, llama_type
        self.adapter_names = tuple(adapter_names)  # lora_modules' names: a request's adapter i is names[i - 1]
        self.ctx: ParallelContext = llma.ctx
        # One stop-token set for every call: EOS, and the chat template's end-of-turn token if it has one.
        self.engine = Engine(llma, tokenizer, engine_settings, tokenizer.chat_stop_ids, draft)

    @classmethod
    def from_pretrained(cls, pretrained_path: Union[PathLike, Sequence[PathLike]], llama_type: Optional[str] = None,
                        llama_config: Optional[Sequence[PathLike]] = None, tokenizer_path: Optional[PathLike] = None,
                        with_visual: bool = False, max_seq_len: int = 4096,
                        mp_group: Optional[torch.distributed.ProcessGroup] = None,
                        dtype: Union[None, str, torch.dtype] = None, device: Union[None, str, torch.device] = None,
                        quant: Union[bool, None, str] = False, *, max_batch_size: int = 32,
                        compile: bool = False, prefix_cache: bool = True,
                        prefix_cache_bytes: int = EngineSettings.prefix_cache_bytes,
                        rank_timeout: float = 60.0, warmup: bool = False,
                        speculative_config: Optional[dict] = None, lora: Optional[PathLike] = None,
                        lora_modules: Optional[dict[str, PathLike]] = None, pipeline_parallel_size: int = 1,
                        pipeline_layers: Optional[str] = None, exact_products: bool = False) -> "MetaModel":
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
        the engine's settings (`model.engine`). `max_batch_size="auto"`: the most rows whose KV cache at
        max_seq_len and step workspace fit the memory each rank has once loaded, less a margin (logged with its
        arithmetic; generation/batch_size.py).

        `speculative_config`: speculative decoding, as vLLM configures it (the output is unchanged; a step may
        add several tokens): {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
        "prompt_lookup_min": M} proposes tokens found in the row's own prompt and output; {"model": PATH,
        "num_speculative_tokens": K} a draft checkpoint's greedy tokens (same tokenizer, same ranks); {"model":
        "self", "quant": "int4"} the checkpoint itself, loaded quantized, as its own draft. See docs/speculative.md.

        `lora`: a Hugging Face PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) applied
        to every request, unmerged, in float (a quantized base stays quantized); each rank holds its slice of the
        factors. `lora_modules` {name: folder}: adapters kept unmerged side by side (`adapter_names`), a request
        choosing one (the server's `model` field; `Request.adapter` i for the i-th name) or none (the base), rows
        of different adapters in one batch; not with `compile` or speculative decoding. See docs/python-api.md.

        `exact_products`: a GGUF's Q4_K / Q5_K / Q6_K / Q5_0 weights (kept bits) multiply x in float32 at every row
        count, as transformers' dequantized model does. By default a prompt's products (GGUF_INT8X_ROWS rows and
        more: kernels/dispatch.py), and a batch-1 decode step's Q5_0, Q4_K and Q6_K products on AVX-512, quantize x
        to int8 per group of 32 and multiply in integers, as llama.cpp does: prompts about 2.5x faster, the weights'
        bits the same, and greedy tokens that may part from transformers' where two tokens' logits nearly tie.
        Process-wide: the last model loaded sets it.

        `warmup`: before returning (`warm_up`), one token of a short prompt, so that a model whose logits are NaN is
        refused by name (ConfigError); with `compile`, every graph the engine will run is compiled too, so no later
        call waits on compilation.

        `rank_timeout` (seconds; at more than one rank): a rank that stops answering (frozen, killed), or ranks
        that are no longer at the same generation step (user code that breaks out of a stream on some ranks only),
        end every rank with a named error within about this long, instead of a hang. A watchdog thread beats for
        each rank (`accessory.parallel.watchdog`); it ends the process when its rank cannot raise.

        `pipeline_parallel_size` (`--pp`): split the model-parallel group's ranks into this many pipeline stages
        of consecutive ranks, each holding a contiguous run of layers (tensor-parallel inside the stage: world =
        data-parallel x pipeline x tensor); each rank reads only its stage's tensors. `pipeline_layers`
        (`--pp-layers`): "even" (the default), "balanced" (each stage's work a token about the same), "auto"
        (by each stage's memory budget) or a count per stage, "12,18". Not with speculative decoding. See
        docs/multinode.md.

        `with_visual`: LLaMA2-Accessory's flag for a model that reads images. A vision-language checkpoint (llama_type
        "llava") loads its vision tower either way; with_visual=True on a text model is an error.
        """
        return cls.from_options(LoadOptions(
            pretrained_path=pretrained_path, llama_type=llama_type, llama_config=llama_config,
            tokenizer_path=tokenizer_path, with_visual=with_visual, max_seq_len=max_seq_len, mp_group=mp_group,
            dtype=dtype, device=device, quant=quant, max_batch_size=max_batch_size, compile=compile,
            prefix_cache=prefix_cache, prefix_cache_bytes=prefix_cache_bytes, rank_timeout=rank_timeout,
            speculative_config=speculative_config, lora=lora, lora_modules=lora_modules,
            pipeline_parallel_size=pipeline_parallel_size, pipeline_layers=pipeline_layers,
            exact_products=exact_products), warmup)

    @classmethod
    def from_options(cls, options: LoadOptions, warmup: bool = False) -> "MetaModel":
        """`from_pretrained` with its arguments as one LoadOptions (what the command line builds from its flags)."""
        loaded = load(options)
        model = cls(loaded.llma, loaded.tokenizer, loaded.llama_type, loaded.settings, loaded.draft,
                    loaded.adapter_names)
        if warmup:
            model.warm_up()
        return model

    def warm_up(self) -> float:
        """Before serving: first one token of a short prompt, so that a model whose logits are NaN (weights or a
        PEFT adapter that hold values that are not finite) is refused by name here, a ConfigError, rather than
        failing every request later. Then, with a compiled engine, compile every graph it runs (the decode step for
        one row, and for several rows with symbolic sizes; with speculative decoding, the verify step and the
        draft's too) by decoding a few tokens at 1 and 2 rows, so that no later request waits on compilation; the
        seconds that took (0 without compile). Collective: every rank calls it. A compilation that fails is a
        ConfigError that says to run without compile."""
        self._check_first_token()
        if not self.engine.settings.compile:
            return 0.0
        start, stops = time.perf_counter(), self.stop_ids
        self.stop_ids = set()  # an early EOS would end a row before its decode steps
        try:
            for batch in (["Hello"], ["Hello", "Hello there"]):
                self.generate(batch, max_gen_len=3)
            if self.engine.settings.speculative is not None:
                self.engine.speculation.compile()
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

    def _check_first_token(self) -> None:
        events = []
        for events in self._stream(["Hello"], None, SamplingParams(max_gen_len=1), (), None, "left"):
            pass
        if events and events[0].error is not None:
            raise ConfigError(f"the model's first token failed: {events[0].error}; its weights (or a PEFT adapter's "
                              f"factors or scaling) are not finite, so it cannot serve")

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
        yield from prompts.changed_events(self._stream(list(prompt) if batch else [prompt], images, params,
                                                additional_stop_symbols, seed, truncate), batch)

    def chat(self, messages: list[dict], max_gen_len: int = 512, temperature: float = 0.0, top_p: float = 0.95,
             seed: Optional[int] = None, *, template: Optional[str] = None, tools: Optional[list[dict]] = None,
             chat_template_kwargs: Optional[dict] = None, **options) -> ChatReply:
        """The assistant's reply to OpenAI-style messages ([{"role": "system"|"user"|"assistant", "content"}]): the
        text it wrote (a str), read for its `reasoning`, `content` and `tool_calls` (generation/chat.py ChatReply)
        in the formats the chat template writes, as the server reads them.

        `template`: None uses the model's own chat template (or LLaMA2-Accessory's default conversation if it has
        none); a name from `accessory.data.conversation.conv_templates` uses that one, with its stop symbols.
        `tools`: OpenAI's function definitions, for a chat template that writes them. `chat_template_kwargs`: more
        variables for the chat template ({"enable_thinking": False}). `image=` (a vision-language model): the
        conversation's image; it goes where a message's content says "<image>", or after BOS.
        """
        names = [tool.get("function", {}).get("name") if isinstance(tool, dict) else None for tool in tools or ()]
        if not all(isinstance(name, str) for name in names):
            raise ValueError(f"tools: each must be {{'type': 'function', 'function': {{'name': str, ...}}}}, got "
                             f"{tools!r:.200}")
        prompt, stops = render_chat(self.tokenizer, messages, template, tools, chat_template_kwargs)
        text = ""
        for event in self._chat_events(prompt, stops, max_gen_len, temperature, top_p, seed, **options):
            text = event.text
        template_text = self.tokenizer.chat_template_text if template is None else ""
        thinking = reasoning_format("auto", template_text)
        fmt = call_format("auto", template_text) if tools else None
        return read_reply(text, thinking and (thinking, opens_reasoning(prompt, thinking)),
                          fmt and ToolReading(fmt, frozenset(names)))

    def stream_chat(self, messages: list[dict], max_gen_len: int = 512, temperature: float = 0.0, top_p: float = 0.95,
                    seed: Optional[int] = None, *, template: Optional[str] = None, tools: Optional[list[dict]] = None,
                    chat_template_kwargs: Optional[dict] = None, **options) -> Iterator[Event]:
        """`chat`, streamed as `stream_generate` streams one prompt (the text as written: not read for reasoning
        or calls)."""
        prompt, stops = render_chat(self.tokenizer, messages, template, tools, chat_template_kwargs)
        yield from self._chat_events(prompt, stops, max_gen_len, temperature, top_p, seed, **options)

    def _chat_events(self, prompt: str, stops: list[str], max_gen_len: int, temperature: float, top_p: float,
                     seed: Optional[int], additional_stop_symbols: Sequence[str] = (), image=None,
                     **options) -> Iterator[Event]:
        yield from self.stream_generate(prompt, image, max_gen_len, temperature, top_p,
                                        [*stops, *additional_stop_symbols], seed, **options)

    def _stream(self, texts: list[str], images, params: SamplingParams, stop_strings, seed, truncate):
        yield from self.engine.stream(prompts.requests_for(self, texts, images, params, stop_strings, seed,
                                                           truncate))

    # ---- prompts and images ----------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, image: bool = False, special: bool = True) -> list[int]:
        """The prompt's token ids, BOS first; with an image, its image tokens where the prompt's "<image>"
        placeholder is, or right after BOS (runtime/prompts.py `encode_prompt`)."""
        return prompts.encode_prompt(self, prompt, image, special)

    def image_transform(self, name: str = "padded_resize"):
        """PIL image -> pixels for this model: `accessory.data.transform.get_transform(name, image_size)` with the
        model's own normalisation. "padded_resize" (default) pads to a square first, as LLaVA-1.5 was trained;
        "resized_center_crop" crops the middle square."""
        return prompts.image_transform(self, name)

    def checked_images(self, images, count: int) -> list:
        """`images` as one entry per prompt (pixels or None), checked against the model."""
        return prompts.checked_images(self, images, count)

    # ---- scoring (runtime/scoring.py) --------------------------------------------------------------------------

    @torch.inference_mode()
    def compute_logits(self, examples: Sequence[Union[str, list[int]]], images=None, bos: bool = True,
                       eos: bool = False) -> list[torch.Tensor]:
        """Float32 logits (len_i, vocab) for every position of each example (text, or token ids). `images` as
        `generate` takes them: a text example's image goes where `encode_prompt` puts it; a token-id example must
        already hold its `image_tokens` image tokens."""
        return scoring.compute_logits(self, examples, images, bos, eos)

    @torch.inference_mode()
    def evaluate_examples(self, examples: Sequence[Union[str, list[int]]],
                          contexts: Optional[Sequence[Union[str, list[int]]]] = None, images=None, bos: bool = True,
                          eos: bool = False) -> dict[str, list]:
        """LLaMA2-Accessory's metrics of each example's tokens after its context (all but the first if none).

        Returns lists, one item per example: "log_likelihood" (sum of token log-probs), "ppl" (mean negative
        log-likelihood per token, LLaMA2-Accessory's name for it), "perplexity" (exp of that), "max_equal" (greedy
        decoding reproduces every token), "non_context_logits" (the logits that predict those tokens).
        """
        return scoring.evaluate_examples(self, examples, contexts, images, bos, eos)

    @torch.inference_mode()
    def next_token_probs(self, prompt: str, top_k: int = 10, temperature: float = 1.0) -> list[tuple[str, float, int]]:
        """The `top_k` likeliest next tokens after `prompt`: [(token_text, probability, token_id), ...], most likely
        first, probabilities from softmax(logits / temperature) over the whole vocabulary."""
        return scoring.next_token_probs(self, prompt, top_k, temperature)
