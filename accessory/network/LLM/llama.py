"""LLaMA 1/2/3 (llama_type "llama"): the config, then the decoder wired from shared blocks in reading order. Every
other family (qwen2, qwen3, mistral, gemma3) is this decoder with other traits: its file subclasses ModelArgs and
states how it differs (docs/adding-a-model.md).

Parameter names are Meta's (LLaMA2-Accessory adds the `llma.` prefix in its shard files), because checkpoints are
keyed on them.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Union

import torch
from torch import nn

from accessory.errors import ConfigError
from accessory.network.components import (PLAIN, Attention, FeedForward, KVCache, Linears, MoEConfig, MoEFeedForward,
                                        RMSNorm, Segment, decode_mask, prefill_mask, rope_frequencies, rope_table,
                                        window_prefill)
from accessory.network.vision import ImagePlacement
from accessory.parallel import (AdapterRouting, ColumnParallelLinear, ParallelContext, ParallelEmbedding,
                                head_placement)
from accessory.parallel.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)


# Keys older config files carry that are engine settings, not the model's (MetaModel.from_pretrained takes them).
ENGINE_KEYS = ("max_batch_size",)


def without_engine_keys(values: dict, source: str) -> dict:
    found = [key for key in ENGINE_KEYS if key in values]
    if found:
        log.info("%s: %s is an engine setting (from_pretrained / --max_batch_size); the file's value is not used",
                 source, ", ".join(found))
    return {k: v for k, v in values.items() if k not in ENGINE_KEYS}


# Each numeric field's type and inclusive range, checked in every config file before anything is built. The bounds
# are far beyond any real model (Llama-3.1-405B: dim 16384, 126 layers, vocab 128256, hidden 53248): they stop a
# config from asking for impossible sizes, and memory is checked separately (check_memory).
FIELD_RANGES = {
    "dim": (int, 1, 1 << 17), "n_layers": (int, 1, 1024), "n_heads": (int, 1, 1 << 12),
    "n_kv_heads": (int, 1, 1 << 12), "vocab_size": (int, -1, 1 << 24), "multiple_of": (int, 1, 1 << 17),
    "ffn_dim_multiplier": (float, 1e-3, 64.0), "hidden_dim": (int, 1, 1 << 20), "norm_eps": (float, 1e-30, 0.1),
    "rope_theta": (float, 1.0, 1e12), "max_seq_len": (int, 1, 1 << 24), "head_dim": (int, 2, 1 << 12),
    "sliding_window": (int, 1, 1 << 24), "rope_local_theta": (float, 1.0, 1e12),
    "query_pre_attn_scalar": (float, 1e-6, 1e9), "final_logit_softcapping": (float, 1e-6, 1e9),
    "load_balancing_weight": (float, 0.0, 1e6),
}
MOE_KEYS = {"num_experts": (int, 1, 1 << 12), "num_experts_per_tok": (int, 1, 1 << 12), "norm_topk_prob": (bool,)}
LAYER_TYPES = ("full", "sliding")


def field_problem(name: str, value, type_name: Optional[str]) -> Optional[str]:
    """Why `value` cannot be config field `name` (whose dataclass annotation is `type_name`), or None."""
    if value is None and name in ("n_kv_heads", "ffn_dim_multiplier", "hidden_dim", "rope_scaling", "head_dim",
                                  "sliding_window", "layer_types", "rope_local_theta", "query_pre_attn_scalar",
                                  "final_logit_softcapping"):
        return None
    if name == "moe":
        return moe_problem(value)
    if name == "layer_types":
        ok = isinstance(value, list) and all(kind in LAYER_TYPES for kind in value)
        return None if ok else f"must be a list of {list(LAYER_TYPES)}, one per layer, got {value!r}"
    if type_name == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if name not in FIELD_RANGES:
        return None
    kind, low, high = FIELD_RANGES[name]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (kind is int and not isinstance(value, int)) or value != value:
        return f"must be {'an integer' if kind is int else 'a number'} in [{low}, {high}], got {value!r}"
    if not low <= value <= high or (name == "vocab_size" and value == 0):
        if name == "vocab_size":
            return f"must be in [1, {high}] (or -1: from the tokenizer), got {value!r}"
        return f"must be in [{low}, {high}], got {value!r}"
    return None


def moe_problem(value) -> Optional[str]:
    """Why `value` cannot be a `moe` config entry ({"num_experts": E, "num_experts_per_tok": k, optionally
    "norm_topk_prob": true/false}), or None."""
    expected = (f'must be {{"num_experts": E, "num_experts_per_tok": k (<= E)[, "norm_topk_prob": true|false]}}, '
                f'got {value!r}')
    if not isinstance(value, dict) or not {"num_experts", "num_experts_per_tok"} <= set(value) <= set(MOE_KEYS):
        return expected
    for key, item in value.items():
        kind, *bounds = MOE_KEYS[key]
        if kind is bool and not isinstance(item, bool):
            return f"{key} must be true or false, got {item!r}"
        if kind is int and (not isinstance(item, int) or isinstance(item, bool) or not bounds[0] <= item <= bounds[1]):
            return f"{key} must be an integer in [{bounds[0]}, {bounds[1]}], got {item!r}"
    if value["num_experts_per_tok"] > value["num_experts"]:
        return f"num_experts_per_tok ({value['num_experts_per_tok']}) exceeds num_experts ({value['num_experts']})"
    return None


@dataclass
class ModelArgs:
    """Model hyper-parameters, as read from params.json / config.json.

    Head counts have one meaning each: `n_heads` and `n_kv_heads` are global; `n_local_heads` and
    `n_local_kv_heads` (per model-parallel rank, which may differ between ranks: whole GQA groups spread unevenly)
    live on the attention module; `n_rep = n_heads // n_kv_heads` is how
    many query heads share one KV head.

    A family's traits are class attributes, not config keys (a config cannot make LLaMA into Qwen3): a family's
    ModelArgs overrides them, and adds the config keys only it has.
    """
    qkv_bias: ClassVar[bool] = False  # wq, wk, wv have biases (Qwen2)
    qk_norm: ClassVar[bool] = False  # an RMSNorm over each head's q and k, before RoPE (Qwen3, Gemma 3)
    hidden_act: ClassVar[str] = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_offset: ClassVar[float] = 0.0  # RMSNorm scales by (norm_offset + weight) (Gemma: 1)
    sandwich_norms: ClassVar[bool] = False  # norms after attention and after the MLP too (Gemma)

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no GQA)
    vocab_size: int = -1  # -1: taken from the tokenizer (Meta's LLaMA-2 params.json says -1)
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    hidden_dim: Optional[int] = None  # explicit SwiGLU hidden size (HF `intermediate_size`); overrides the rule
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None; a float (LLaMA2-Accessory's linear position scaling factor); or a dict with "rope_type" "linear"
    # ({"factor"}) or "llama3" ({"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}).
    rope_scaling: Union[None, float, dict] = None
    use_scaled_rope: bool = False  # Meta's LLaMA-3.1 params.json flag: llama3 scaling with Meta's defaults
    tie_word_embeddings: bool = False  # output projection shares tok_embeddings' weight (no `output` tensor saved)
    max_seq_len: int = 2048  # positions the rotary table covers; from_pretrained sets it
    load_pretrained_visual_encoder: bool = False  # LLaMA2-Accessory training flag; no effect on inference
    head_dim: Optional[int] = None  # None: dim / n_heads (Mistral-Nemo, Qwen3 and Gemma 3 set their own)
    # Sliding-window attention: on the layers `layer_types` says "sliding" (all of them if it is None), each token
    # attends to the last `sliding_window` positions (itself included). None: every layer attends to everything.
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None  # "full" or "sliding", per layer

    def __post_init__(self):
        self.check_values(self.to_dict())
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or head_dim "
                                  f"given")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for n_layers {self.n_layers}")

    @classmethod
    def check_keys(cls, values: dict, source: str) -> None:
        """Reject unknown keys, naming them and the file they came from."""
        known = {f.name for f in dataclasses.fields(cls)} | set(ENGINE_KEYS)
        unknown = sorted(set(values) - known)
        if unknown:
            hint = ""
            if "hidden_size" in values or "architectures" in values:
                hint = " This looks like a Hugging Face model folder: import it with `accessory convert hf SRC DST`."
            raise ConfigError(f"{source}: unknown model config key(s) {unknown}; known keys: {sorted(known)}.{hint}")

    @classmethod
    def check_values(cls, values: dict, source: Optional[str] = None) -> None:
        """Reject a value of the wrong type or out of range, naming the file, the field and what it must be."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, value in values.items():
            problem = field_problem(name, value, types.get(name))
            if problem:
                raise ConfigError(f"{source + ': ' if source else ''}{name} {problem}")

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "ModelArgs":
        values = without_engine_keys(values, source)
        cls.check_keys(values, source)
        try:  # __post_init__ checks the values
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer`, or None (it attends to every position)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] == "full"):
            return None
        return self.sliding_window

    def rope(self, window: Optional[int]) -> tuple[float, Union[None, float, dict]]:
        """(theta, scaling) of the rotary embedding of a layer with that window (Gemma 3 gives sliding layers
        their own base)."""
        if self.use_scaled_rope and self.rope_scaling is None:
            return self.rope_theta, {"rope_type": "llama3"}  # Meta's LLaMA-3.1 defaults (LLAMA3_ROPE_DEFAULTS)
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.head_dim ** -0.5

    @property
    def embedding_scale(self) -> Optional[float]:
        """The embeddings are multiplied by this (in the model's dtype), or None."""
        return None

    @property
    def logit_softcap(self) -> Optional[float]:
        """Final logits become cap * tanh(logits / cap), or None."""
        return None

    @property
    def experts(self) -> Optional[MoEConfig]:
        """The mixture of experts every layer's feed-forward is (mixtral, qwen3_moe), or None: a dense MLP."""
        return None

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)  # Meta's SwiGLU rule
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def allowed_parallel_sizes(self, limit: int = 64) -> list[int]:
        return [n for n in range(1, limit + 1) if not self.parallel_size_problem(n)]

    def parallel_size_problem(self, world: int) -> Optional[str]:
        """Why this model cannot run at `world` model-parallel ranks, or None if it can."""
        # Heads go in whole GQA groups, unevenly where needed (parallel/layers.py head_placement).
        if world > self.n_heads:
            return f"n_heads ({self.n_heads}) is less than the model-parallel size ({world}): each rank needs a head"
        if world > self.n_kv_heads and world % self.n_kv_heads:
            return (f"the model-parallel size ({world}) is more than n_kv_heads ({self.n_kv_heads}) but not a "
                    f"multiple of it (beyond one KV head per rank, each KV head is copied on as many ranks)")
        if self.dim % world:
            return f"dim ({self.dim}) is not divisible by the model-parallel size ({world}) (the embedding's split)"
        return None

    def check_parallel_size(self, world: int) -> None:
        problem = self.parallel_size_problem(world)
        if problem:
            raise ConfigError(f"cannot run this model at {world} model-parallel ranks: {problem}; "
                              f"it runs at {self.allowed_parallel_sizes()} ranks")


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

    def prefill(self, x, rotations, rows, positions, segments, masks) -> torch.Tensor:
        attended = self.attention.prefill(self.attention_norm(x), rotations, rows, positions, segments, masks)
        return self._ffn(x + self._normed(attended, self.post_attention_norm))

    def decode(self, x, rotations, positions, mask) -> torch.Tensor:
        attended = self.attention.decode(self.attention_norm(x), rotations, positions, mask)
        return self._ffn(x + self._normed(attended, self.post_attention_norm))

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        return h + self._normed(self.feed_forward(self.ffn_norm(h)), self.post_ffn_norm)

    @staticmethod
    def _normed(x: torch.Tensor, norm: Optional[RMSNorm]) -> torch.Tensor:
        return x if norm is None else norm(x)


# The attention weights that quantization covers (with the feed-forward's: its `linear_names`; LoRA factors,
# biases, norms and a mixture's router stay float).
ATTENTION_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")


class Transformer(nn.Module):
    """The language model. Build it on the meta device, optionally `quantize_` it, then `materialize` it and load
    weights into it. Three entry points share the weights: `forward` (scoring whole sequences), `prefill` and
    `decode` (the engine's, on the KV cache; they return this rank's slice of the logits, ungathered)."""

    # Per-request PEFT adapters (checkpoint/peft_adapter.py attaches them): which adapter each token and cache row
    # runs with; None without them.
    adapter_routing: Optional[AdapterRouting] = None

    def __init__(self, args: ModelArgs, ctx: ParallelContext):
        super().__init__()
        args.check_parallel_size(ctx.world_size)
        self.args, self.ctx = args, ctx
        self.tok_embeddings = ParallelEmbedding(args.vocab_size, args.dim, ctx)
        linears = self.block_linears(args)
        self.windows = [args.layer_window(i) for i in range(args.n_layers)]  # None: a full-attention layer
        self.layers = nn.ModuleList(TransformerBlock(args, ctx, linears, window) for window in self.windows)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, offset=args.norm_offset)
        self.output = ColumnParallelLinear(args.dim, args.vocab_size, ctx, gather_output=True)
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
        the two hold different slices of it (vocabulary rows and feature columns) and load it separately."""
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
        return {f"layers.{i}.feed_forward.{name}" for i, layer in enumerate(self.layers)
                for name in layer.feed_forward.held_elsewhere()}

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
        for i, layer in enumerate(self.layers):  # w2's inputs are split on its blocks, and w1's, w3's outputs alike
            layer.feed_forward.align_for(formats, f"layers.{i}.feed_forward.")
        if self.args.tie_word_embeddings and "tok_embeddings.weight" in formats:
            formats = {**formats, "output.weight": formats["tok_embeddings.weight"]}
        held_elsewhere = self.held_elsewhere()
        for name, fmt in formats.items():
            if name in held_elsewhere:
                continue  # an expert another rank holds
            layer_name = name.removesuffix(".weight")
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

    # ---- KV cache (allocated and released by the engine) -----------------------------------------------------

    def setup_caches(self, rows: int, columns: int) -> None:
        """Make sure every layer has a KV cache of exactly `rows` sequences of `columns` positions (a sliding-window
        layer's: a ring of its window, if that is shorter)."""
        if columns > self.args.max_seq_len:
            raise ValueError(f"{columns} positions requested; the model was set up for max_seq_len "
                             f"{self.args.max_seq_len}")
        if self.cache_shape == (rows, columns):
            return
        self.free_caches()  # before allocating, so the old and new never coexist
        for layer, window in zip(self.layers, self.windows):
            attn, width = layer.attention, self._cache_columns(window, columns)
            attn.cache = KVCache(rows, attn.n_local_kv_heads, width, attn.head_dim, self.dtype, self.device,
                                 ring=width < columns)
        self._columns = columns
        if self.adapter_routing is not None:
            self.adapter_routing.set_rows(rows, self.device)

    @staticmethod
    def _cache_columns(window: Optional[int], columns: int) -> int:
        return columns if window is None else min(window, columns)

    def free_caches(self) -> None:
        for layer in self.layers:
            layer.attention.cache = None
        self._columns = None

    @property
    def cache_shape(self) -> Optional[tuple[int, int]]:
        """(rows, positions) of the KV cache, or None."""
        cache = self.layers[0].attention.cache
        return None if cache is None else (cache.k.shape[0], self._columns)

    @property
    def cache_nbytes(self) -> int:
        """Bytes of the KV cache on the rank holding the most KV heads: the same on every rank (see below)."""
        shape = self.cache_shape
        return 0 if shape is None else shape[0] * self.cache_row_nbytes(shape[1])

    def cache_row_nbytes(self, columns: int) -> int:
        """Bytes one KV-cache row of `columns` positions takes (every layer's keys and values) on the rank holding
        the most KV heads, rank 0: with uneven head splits ranks hold different numbers, and what is decided from
        this (rows kept for the prefix cache, a cache kept between runs) must be decided alike on every rank."""
        args, attn = self.args, self.layers[0].attention
        kv_heads = len(head_placement(args.n_heads, args.n_kv_heads, self.ctx.world_size, 0).kv_heads)
        widths = sum(self._cache_columns(window, columns) for window in self.windows)
        return 2 * kv_heads * attn.head_dim * widths * self.dtype.itemsize

    def reusable_prefix(self, length: int, held: int) -> int:
        """How much of a `length`-token prefix shared with a cache row holding `held` tokens can be copied from it
        (prefix caching): all of it, unless a sliding-window ring of the row no longer holds the positions just
        before `length` (the row went on past them), then none."""
        rings = [self._cache_columns(w, self._columns) for w in self.windows if w is not None and self._columns]
        if not rings or held <= min(rings) or length == held:
            return length
        return 0

    def move_cache_rows(self, dst: list[int], src: list[int], end: int) -> None:
        for layer in self.layers:
            layer.attention.cache.move_rows(dst, src, end)
        if self.adapter_routing is not None:
            self.adapter_routing.move_rows(dst, src)

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
        h = self.embed(tokens, images)
        if self.adapter_routing is not None:
            self.adapter_routing.tokens = None  # scoring runs the base model (and an adapter every token uses)
        for layer, rotations in zip(self.layers, self._rotations(slice(0, tokens.shape[1]))):
            h = layer(h, rotations[None])
        logits = self._logits(h)
        return self.output.gathered(logits) if gather else logits

    def prefill(self, tokens: torch.Tensor, segments: list[Segment],
                images: Sequence[Optional[torch.Tensor]] = ()) -> torch.Tensor:
        """Prompts packed into tokens (T,), one per segment: each is written to its cache row from column
        `past` on, attending to that row's first `past` columns too. `images`: each segment's image pixels, or
        None. This rank's logits (segments, local vocab) at each segment's last token."""
        device = tokens.device
        rows = torch.tensor([seg.row for seg in segments for _ in range(seg.length)], device=device)
        positions = torch.tensor([p for seg in segments for p in range(seg.past, seg.past + seg.length)],
                                 device=device)
        masks = {None: [prefill_mask(seg.past, seg.length, device) for seg in segments]}  # the same in every layer
        for layer, window in zip(self.layers, self.windows):  # and in every sliding layer
            if window is not None and window not in masks:
                masks[window] = [window_prefill(seg, window, layer.attention.cache.columns, device)
                                 for seg in segments]
        placements = [ImagePlacement(0, seg.start, seg.start + seg.length, pixels)
                      for seg, pixels in zip(segments, images) if pixels is not None]
        h = self.embed(tokens[None], placements)  # (1, T, dim)
        if self.adapter_routing is not None:
            self._route_prefill(segments, device)
        for layer, window, rotations in zip(self.layers, self.windows, self._rotations(positions)):
            h = layer.prefill(h, rotations[None], rows, positions, segments, masks[window])
        last = torch.tensor([seg.start + seg.length - 1 for seg in segments], device=device)
        return self._logits(h[0, last])

    def _route_prefill(self, segments: list[Segment], device: torch.device) -> None:
        """Per-request adapters: each prompt's tokens run with its row's adapter, which the row keeps."""
        routing = self.adapter_routing
        routing.tokens = torch.tensor([[seg.adapter for seg in segments for _ in range(seg.length)]], device=device)
        routing.rows[[seg.row for seg in segments]] = torch.tensor([seg.adapter for seg in segments], device=device)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One token per cache row 0..B-1: tokens and positions (B,), mask (B, 1, 1, C) from `decode_mask`. This
        rank's logits (B, local vocab). Static shapes, no host sync: the engine may compile it."""
        return self._decode_rows(tokens[:, None], positions[:, None], mask)[:, 0]

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """L tokens per cache row 0..B-1 (speculative decoding: a row's next token and the proposals after it), each
        written to the cache at its position and attending to the row's columns up to it: tokens and positions
        (B, L), mask (B, 1, L, C) from `decode_mask`. This rank's logits (B, L, local vocab). Static shapes, no host
        sync. Not on sliding-window layers: a rejected proposal would overwrite a ring column still in the window."""
        if self.has_rings:
            raise ValueError("verify needs every layer's KV cache full-width; this model has sliding-window rings")
        return self._decode_rows(tokens, positions, mask)

    @property
    def has_rings(self) -> bool:
        """Whether some layers keep only a sliding window of positions (a ring) in the KV cache."""
        return any(layer.attention.cache is not None and layer.attention.cache.ring for layer in self.layers)

    def _decode_rows(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """tokens and positions (B, L), mask (B, 1, L, C) -> this rank's logits (B, L, local vocab)."""
        h = self._scaled(self.tok_embeddings(tokens, self.dtype))  # (B, L, dim)
        if self.adapter_routing is not None:  # each row's adapter, for each of its L tokens
            self.adapter_routing.tokens = self.adapter_routing.rows[:tokens.shape[0], None].expand(tokens.shape)
        masks = {None: mask}
        for layer, window in zip(self.layers, self.windows):  # a ring's written columns: (B, 1, 1, its columns)
            if window is not None and window not in masks:
                cache = layer.attention.cache
                masks[window] = decode_mask(positions[:, -1], cache.columns) if cache.ring else mask
        for layer, window, rotations in zip(self.layers, self.windows, self._rotations(positions)):
            h = layer.decode(h, rotations, positions, masks[window])  # rotations (B, L, D/2, 2)
        return self._logits(h)
