"""LLaMA 1/2/3 (llama_type "llama"): the decoder wired from shared blocks in reading order, on its config
(network/config.py: ModelArgs). Every other family (qwen2, qwen3, mistral, gemma3) is this decoder with other traits:
its file subclasses ModelArgs and states how it differs (docs/adding-a-model.md).

Parameter names are Meta's (LLaMA2-Accessory adds the `llma.` prefix in its shard files), because checkpoints are
keyed on them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from accessory.errors import ConfigError
from accessory.network.components import (PLAIN, Attention, FeedForward, Linears, MoEFeedForward, RMSNorm,
                                        Segment, decode_mask, prefill_mask, rope_frequencies, rope_table,
                                        window_prefill)
from accessory.network.config import ModelArgs
from accessory.network.kv_caches import KVCache, KVCaches
from accessory.network.vision import ImagePlacement
from accessory.parallel import AdapterRouting, ColumnParallelLinear, ParallelContext, ParallelEmbedding
from accessory.parallel.pipeline import Stage
from accessory.parallel.quantized_weight import QuantizedWeight


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then h + mlp(norm(h)); with sandwich norms (Gemma), each branch's output is normed
    too (`post_attention_norm`, `post_ffn_norm`) before it is added."""

    def __init__(self, args: ModelArgs, ctx: ParallelContext, linears: Linears = PLAIN, window: Optional[int] = None):
        super().__init__()
        norm = lambda: RMSNorm(args.dim, eps=args.norm_eps, offset=args.norm_offset)  # noqa: E731
        self.attention = Attention(args, ctx, linears, window)
        if args.experts is not None:
            self.feed_forward = MoEFeedForward(args.dim, args.ffn_hidden_dim, args.experts, ctx, args.hidden_act)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, ctx, linears, args.hidden_act)
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.post_attention_norm = self.post_ffn_norm = None
        if args.sandwich_norms:
            self.post_attention_norm, self.post_ffn_norm = norm(), norm()

    def forward(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        return self._ffn(x + self._normed(self.attention(self.attention_norm(x), rotations), self.post_attention_norm))

    def prefill(self, x, rotations, rows, positions, segments, masks, cache: KVCache) -> torch.Tensor:
        attended = self.attention.prefill(self.attention_norm(x), rotations, rows, positions, segments, masks, cache)
        return self._ffn(x + self._normed(attended, self.post_attention_norm))

    def decode(self, x, rotations, positions, mask, cache: KVCache) -> torch.Tensor:
        attended = self.attention.decode(self.attention_norm(x), rotations, positions, mask, cache)
        return self._ffn(x + self._normed(attended, self.post_attention_norm))

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        return h + self._normed(self.feed_forward(self.ffn_norm(h)), self.post_ffn_norm)

    @staticmethod
    def _normed(x: torch.Tensor, norm: Optional[RMSNorm]) -> torch.Tensor:
        return x if norm is None else norm(x)


# The attention weights that quantization covers (with the feed-forward's: its `linear_names`; LoRA factors,
# biases, norms and a mixture's router stay float).
ATTENTION_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")


class StageLayers(nn.ModuleList):
    """A pipeline stage's blocks, named by their index in the whole model ("layers.15" on whichever stage holds
    layer 15), so that checkpoint names and a stage's tensor names agree; indexed and iterated from the stage's first
    block."""

    def __init__(self, first: int, blocks):
        nn.Module.__init__(self)
        for i, block in enumerate(blocks):
            self.add_module(str(first + i), block)

    def __getitem__(self, index):
        return list(self._modules.values())[index]


class Transformer(nn.Module):
    """The language model. Build it on the meta device, optionally `quantize_` it, then `materialize` it and load
    weights into it. Three entry points share the weights: `forward` (scoring whole sequences), `prefill` and
    `decode` (the engine's, on the KV caches they are given, kv_caches.py; they return this rank's slice of the
    logits, ungathered).

    Under a pipeline (`stage`: parallel/pipeline.py) the model is one stage of the whole: its run of layers, the
    embedding on the first stage, the head on the last. Each entry point then takes the previous stage's hidden
    states in place of tokens (but on the first stage) and returns its own (but on the last); `through` runs one
    as a stage, receiving and sending them. `ctx` is the whole model's group (what the engine shares plans over);
    the layers' collectives are the stage's own (`stage.tensor`)."""

    # Per-request PEFT adapters (checkpoint/peft_adapter.py attaches them): which adapter each token runs with (each
    # cache row's is in KVCaches.adapters); None without them.
    adapter_routing: Optional[AdapterRouting] = None

    def __init__(self, args: ModelArgs, ctx: ParallelContext, stage: Optional[Stage] = None):
        super().__init__()
        self.args, self.ctx = args, ctx
        self.stage = stage = stage or Stage.whole(args.n_layers, ctx)
        tensor = stage.tensor
        args.check_parallel_size(tensor.world_size)
        self.tok_embeddings = ParallelEmbedding(args.vocab_size, args.dim, tensor) if stage.first else None
        linears = self.block_linears(args)
        self.windows = [args.layer_window(i) for i in stage.layers]  # None: a full-attention layer
        self.layers = StageLayers(stage.layers.start, (TransformerBlock(args, tensor, linears, window)
                                                       for window in self.windows))
        # every stage has the final norm (a vector): the last applies it, the others read their dtype from it
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, offset=args.norm_offset)
        self.output = ColumnParallelLinear(args.dim, args.vocab_size, tensor, gather_output=True) if stage.last \
            else None
        self._tie_embeddings()
        # (max_seq_len, head_dim / 2, 2) float32 rotations, one table per rotary embedding the layers use (Gemma 3's
        # sliding layers have their own), filled by materialize. Buffers (not saved), so a compiled step treats
        # their shapes as fixed, as it does the weights'.
        self.ropes = []  # (theta, scaling) of each table
        for window in self.windows:
            if args.rope(window) not in self.ropes:
                self.ropes.append(args.rope(window))
        self.rope_of = [self.ropes.index(args.rope(window)) for window in self.windows]  # layer -> table
        for i in range(len(self.ropes)):
            self.register_buffer(f"rotations{i}", torch.empty(args.max_seq_len, args.head_dim // 2, 2),
                                 persistent=False)

    def block_linears(self, args: ModelArgs) -> Linears:
        """The linear layers of the blocks' attention and feed-forward; a variant (llama_peft) overrides this."""
        return PLAIN

    def _tie_embeddings(self) -> None:
        """At one rank a tied output projection is the embedding table itself (one copy in memory); at more ranks
        the two hold different slices of it (vocabulary rows and feature columns), or are on different pipeline
        stages, and load it separately."""
        if self.args.tie_word_embeddings and self.ctx.world_size == 1:
            del self.output.weight  # a parameter, or a quantized module, is replaced by the embedding's own
            self.output.weight = self.tok_embeddings.weight

    def checkpoint_key(self, name: str) -> str:
        """The checkpoint tensor a model tensor is loaded from: a tied output loads from tok_embeddings."""
        if self.args.tie_word_embeddings and name.startswith("output.weight"):
            return "tok_embeddings.weight" + name[len("output.weight"):]
        return name

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> this rank's tensor, for the tensors a checkpoint of this model holds: parameters and
        quantized parts (not KV caches), each once (a tied output is tok_embeddings' tensor)."""
        return {name: t for name, t in self.state_dict(keep_vars=True).items() if self.checkpoint_key(name) == name}

    def held_elsewhere(self) -> set[str]:
        """Checkpoint names of this model's tensors that other ranks hold and this one does not (a mixture's experts
        placed on other ranks): a checkpoint has them, and this rank does not load them."""
        return {f"layers.{i}.feed_forward.{name}" for i, layer in zip(self.stage.layers, self.layers)
                for name in layer.feed_forward.held_elsewhere()}

    def on_other_stage(self, key: str) -> bool:
        """Whether checkpoint tensor `key` belongs to another pipeline stage (its layers, the embedding off the first
        stage but for a tied head, the head off the last): this rank neither holds nor reads it."""
        if self.stage.count == 1:
            return False
        head, _, rest = key.partition(".")
        if head == "layers":
            index = rest.partition(".")[0]
            return index.isdigit() and int(index) not in self.stage.layers
        tied_head = self.stage.last and self.args.tie_word_embeddings  # the head loads from the embedding's table
        return (head == "tok_embeddings" and not (self.stage.first or tied_head)) or \
            (head == "output" and not self.stage.last)

    # ---- quantization -----------------------------------------------------------------------------------------

    def quantization_plan(self, fmt: str) -> dict[str, str]:
        """Weight name -> format for `quant=fmt`: every block linear in `fmt`; the embedding table and the output
        projection in int8 (at 4 bits they cost the most quality for the least memory, as in llama.cpp's mixes)."""
        linears = [*ATTENTION_LINEARS, *(f"feed_forward.{name}" for name in self.layers[0].feed_forward.linear_names())]
        plan = {f"layers.{i}.{linear}.weight": fmt for i in range(self.args.n_layers) for linear in linears}
        plan["tok_embeddings.weight"] = "int8"
        if not self.args.tie_word_embeddings:
            plan["output.weight"] = "int8"
        return plan

    def quantize_(self, formats: dict[str, str]) -> None:
        """Hold the named weights in those formats (on the meta device, before materialize and loading)."""
        for i, layer in zip(self.stage.layers, self.layers):  # w2's inputs are split on its blocks, w1's and w3's
            layer.feed_forward.align_for(formats, f"layers.{i}.feed_forward.")  # outputs alike
        if self.args.tie_word_embeddings and "tok_embeddings.weight" in formats:
            formats = {**formats, "output.weight": formats["tok_embeddings.weight"]}
        held_elsewhere = self.held_elsewhere()
        for name, fmt in formats.items():
            layer_name = name.removesuffix(".weight")
            if name in held_elsewhere or self.on_other_stage(name) or getattr(self, layer_name, True) is None:
                continue  # an expert another rank holds, another stage's tensor, or a tied head's table
            try:
                if self.args.tie_word_embeddings and self.ctx.world_size == 1 and layer_name == "output":
                    continue  # the same weight as tok_embeddings, quantized there
                self.get_submodule(layer_name).quantize_(fmt)
            except (AttributeError, ValueError) as e:
                raise ConfigError(f"cannot quantize {name} as {fmt}: {e}") from e
        self._tie_embeddings()

    @property
    def quantization(self) -> dict[str, str]:
        """Weight name -> format of every quantized weight (empty for a float model)."""
        return {f"{name}.weight": module.weight.fmt for name, module in self.named_modules()
                if isinstance(getattr(module, "weight", None), QuantizedWeight)
                and self.checkpoint_key(f"{name}.weight") == f"{name}.weight"}

    def materialize(self, device: torch.device, dtype: torch.dtype) -> "Transformer":
        """Give the meta-device tensors real (uninitialised) storage: float parameters in `dtype`, quantized parts
        in their own dtypes, the projections that share an input stacked (FusedColumns); and compute the rotary
        table."""
        for param in self.parameters():
            param.data = param.data.to(dtype)  # free on the meta device
        self.to_empty(device=device)
        self._tie_embeddings()  # to_empty gives each module its own new parameter: share the table again
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()
        for i, (theta, scaling) in enumerate(self.ropes):
            freqs, scale = rope_frequencies(self.args.head_dim, theta, scaling)
            getattr(self, f"rotations{i}").copy_(rope_table(freqs, self.args.max_seq_len, device, scale))
        return self

    def _rotations(self, index) -> list[torch.Tensor]:
        """Each layer's rotations at `index` (positions): one lookup per table."""
        tables = [getattr(self, f"rotations{i}")[index] for i in range(len(self.ropes))]
        return [tables[i] for i in self.rope_of]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    # ---- the three entry points ------------------------------------------------------------------------------

    image_tokens = 0  # token positions an image fills (a vision-language type's); a text model takes none
    image_token: Optional[int] = None  # the token id those positions hold

    def embed(self, tokens: torch.Tensor, images: Sequence[ImagePlacement] = ()) -> torch.Tensor:
        """The input embeddings (..., dim) of `tokens`; a vision-language type (llava) writes its images' over
        their image tokens."""
        if images:
            raise ValueError("this model reads text only: it has no vision encoder for images (a vision-language "
                             "llama_type such as 'llava' has one)")
        return self._scaled(self.tok_embeddings(tokens, self.dtype))

    def _enter(self, tokens: torch.Tensor, images: Sequence[ImagePlacement] = ()) -> torch.Tensor:
        """The first layer's input: the embeddings of `tokens`; on a later pipeline stage, `tokens` are the previous
        stage's hidden states already."""
        return self.embed(tokens, images) if self.stage.first else tokens

    def stage_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """What this stage's entry points take for `tokens`: the tokens on the first stage, else hidden states of
        their shape (zeros: an example, to compile a step with)."""
        if self.stage.first:
            return tokens
        return torch.zeros(*tokens.shape, self.args.dim, dtype=self.dtype, device=self.device)

    def through(self, step, tokens: torch.Tensor, *args, lead: Optional[tuple[int, ...]] = None, **kwargs):
        """`step(tokens, *args, **kwargs)`, one of this model's entry points (or a compiled decode step), run as this
        rank's pipeline stage: a later stage takes the previous one's hidden states for `tokens` (tokens.shape +
        (dim,)), and an earlier stage sends its own on and returns no logits, a (*lead, 0) tensor (`lead`: the
        logits' leading shape, tokens.shape unless given). Without a pipeline, just the step."""
        stage = self.stage
        if stage.count == 1:
            return step(tokens, *args, **kwargs)
        x = tokens if stage.first else stage.receive((*tokens.shape, self.args.dim), self.dtype, self.device)
        out = step(x, *args, **kwargs)
        if stage.last:
            return out
        stage.send(out)
        return torch.empty(*(tokens.shape if lead is None else lead), 0, device=self.device)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        scale = self.args.embedding_scale
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)  # rounded to the dtype, as HF does

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final hidden states h, this rank's slice, soft-capped if the family does."""
        logits = self.output.project(self.norm(h)).float()
        cap = self.args.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, images: Sequence[ImagePlacement] = (),
                gather: bool = True) -> torch.Tensor:
        """Float32 logits (B, L, vocab) of whole sequences (B, L) from position 0, on every rank; nothing is
        cached (scoring). `images`: where images go. `gather=False`: this rank's slice of the vocabulary only."""
        h = self._enter(tokens, images)
        if self.adapter_routing is not None:
            self.adapter_routing.tokens = None  # scoring runs the base model (and an adapter every token uses)
        for layer, rotations in zip(self.layers, self._rotations(slice(0, tokens.shape[1]))):
            h = layer(h, rotations[None])
        if not self.stage.last:
            return h
        logits = self._logits(h)
        return self.output.gathered(logits) if gather else logits

    def prefill(self, tokens: torch.Tensor, segments: list[Segment], caches: KVCaches,
                images: Sequence[Optional[torch.Tensor]] = ()) -> torch.Tensor:
        """Prompts packed into tokens (T,), one per segment: each is written to its row of `caches` from column
        `past` on, attending to that row's first `past` columns too. `images`: each segment's image pixels, or
        None. This rank's logits (segments, local vocab) at each segment's last token."""
        device = tokens.device
        rows = torch.tensor([seg.row for seg in segments for _ in range(seg.length)], device=device)
        positions = torch.tensor([p for seg in segments for p in range(seg.past, seg.past + seg.length)],
                                 device=device)
        masks = {None: [prefill_mask(seg.past, seg.length, device) for seg in segments]}  # the same in every layer
        for cache, window in zip(caches.layers, self.windows):  # and in every sliding layer
            if window is not None and window not in masks:
                masks[window] = [window_prefill(seg, window, cache.columns, device) for seg in segments]
        placements = [ImagePlacement(0, seg.start, seg.start + seg.length, pixels)
                      for seg, pixels in zip(segments, images) if pixels is not None]
        h = self._enter(tokens[None], placements)  # (1, T, dim)
        if self.adapter_routing is not None:
            self._route_prefill(segments, caches.adapters, device)
        for layer, cache, window, rotations in zip(self.layers, caches.layers, self.windows,
                                                   self._rotations(positions)):
            h = layer.prefill(h, rotations[None], rows, positions, segments, masks[window], cache)
        last = torch.tensor([seg.start + seg.length - 1 for seg in segments], device=device)
        return self._logits(h[0, last]) if self.stage.last else h[0]

    def _route_prefill(self, segments: list[Segment], rows: torch.Tensor, device: torch.device) -> None:
        """Per-request adapters: each prompt's tokens run with its row's adapter, which the row keeps (`rows`)."""
        self.adapter_routing.tokens = torch.tensor([[seg.adapter for seg in segments for _ in range(seg.length)]],
                                                   device=device)
        rows[[seg.row for seg in segments]] = torch.tensor([seg.adapter for seg in segments], device=device)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               caches: KVCaches) -> torch.Tensor:
        """One token per row 0..B-1 of `caches`: tokens and positions (B,), mask (B, 1, 1, C) from `decode_mask`.
        This rank's logits (B, local vocab). Static shapes, no host sync: the engine may compile it."""
        return self._decode_rows(tokens[:, None], positions[:, None], mask, caches)[:, 0]

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               caches: KVCaches) -> torch.Tensor:
        """L tokens per cache row 0..B-1 (speculative decoding: a row's next token and the proposals after it), each
        written to the cache at its position and attending to the row's columns up to it: tokens and positions
        (B, L), mask (B, 1, L, C) from `decode_mask`. This rank's logits (B, L, local vocab). Static shapes, no host
        sync. Not on sliding-window layers: a rejected proposal would overwrite a ring column still in the window."""
        if caches.has_rings:
            raise ValueError("verify needs every layer's KV cache full-width; this model has sliding-window rings")
        return self._decode_rows(tokens, positions, mask, caches)

    def _decode_rows(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     caches: KVCaches) -> torch.Tensor:
        """tokens and positions (B, L), mask (B, 1, L, C) -> this rank's logits (B, L, local vocab)."""
        h = self._enter(tokens)  # (B, L, dim)
        if self.adapter_routing is not None:  # each row's adapter, for each of its L tokens
            self.adapter_routing.tokens = caches.adapters[:tokens.shape[0], None].expand(tokens.shape)
        masks = {None: mask}
        for cache, window in zip(caches.layers, self.windows):  # a ring's written columns: (B, 1, 1, its columns)
            if window is not None and window not in masks:
                masks[window] = decode_mask(positions[:, -1], cache.columns) if cache.ring else mask
        for layer, cache, window, rotations in zip(self.layers, caches.layers, self.windows,
                                                   self._rotations(positions)):
            h = layer.decode(h, rotations, positions, masks[window], cache)  # rotations (B, L, D/2, 2)
        return self._logits(h) if self.stage.last else h
