"""LLaMA 1/2/3 (llama_type "llama"): the config, then the model wired from shared blocks in reading order.

Parameter names are Meta's (LLaMA2-Accessory adds the `llma.` prefix in its shard files), because checkpoints are
keyed on them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from accessory.errors import ConfigError
from accessory.model.components import (PLAIN, Attention, CacheAt, FeedForward, KVCache, Linears, RMSNorm,
                                        attention_mask, rope_frequencies, rope_table)
from accessory.parallel import ColumnParallelLinear, ParallelContext, ParallelEmbedding


@dataclass
class ModelArgs:
    """Model hyper-parameters, as read from params.json / config.json.

    Head counts have one meaning each: `n_heads` and `n_kv_heads` are global; `n_local_heads` and
    `n_local_kv_heads` (per model-parallel rank) live on the attention module; `n_rep = n_heads // n_kv_heads` is how
    many query heads share one KV head.
    """
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
    max_batch_size: int = 32
    max_seq_len: int = 2048
    load_pretrained_visual_encoder: bool = False  # LLaMA2-Accessory training flag; no effect on inference

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head dim ({self.head_dim} = dim / n_heads) must be even for rotary embeddings")

    @classmethod
    def check_keys(cls, values: dict, source: str) -> None:
        """Reject unknown keys, naming them and the file they came from."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            hint = ""
            if "hidden_size" in values or "architectures" in values:
                hint = " This looks like a Hugging Face model folder: import it with `accessory convert hf SRC DST`."
            raise ConfigError(f"{source}: unknown model config key(s) {unknown}; known keys: {sorted(known)}.{hint}")

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "ModelArgs":
        cls.check_keys(values, source)
        return cls(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

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
        if self.n_heads % world:
            return f"n_heads ({self.n_heads}) is not divisible by the model-parallel size ({world})"
        if self.n_kv_heads % world and world % self.n_kv_heads:
            return (f"n_kv_heads ({self.n_kv_heads}) and the model-parallel size ({world}) must divide one "
                    f"another (KV heads are split, or replicated when ranks outnumber them)")
        return None

    def check_parallel_size(self, world: int) -> None:
        problem = self.parallel_size_problem(world)
        if problem:
            raise ConfigError(f"cannot run this model at {world} model-parallel ranks: {problem}; "
                              f"it runs at {self.allowed_parallel_sizes()} ranks")


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, ctx: ParallelContext, linears: Linears = PLAIN):
        super().__init__()
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, ctx, linears)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, ctx, linears)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, mask: Optional[torch.Tensor] = None,
                at: Optional[CacheAt] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rotations, mask, at)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The language model. Build it on the meta device, then `materialize` it and load weights into it."""

    def __init__(self, args: ModelArgs, ctx: ParallelContext):
        super().__init__()
        args.check_parallel_size(ctx.world_size)
        self.args, self.ctx = args, ctx
        self.tok_embeddings = ParallelEmbedding(args.vocab_size, args.dim, ctx)
        linears = self.block_linears(args)
        self.layers = nn.ModuleList(TransformerBlock(args, ctx, linears) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = ColumnParallelLinear(args.dim, args.vocab_size, ctx, gather_output=True)
        self.rotations: Optional[torch.Tensor] = None  # (max_seq_len, head_dim / 2) complex, made by materialize

    def block_linears(self, args: ModelArgs) -> Linears:
        """The linear layers of the blocks' attention and feed-forward; a variant (llama_peft) overrides this."""
        return PLAIN

    def checkpoint_key(self, param_name: str) -> str:
        """The checkpoint tensor a parameter is loaded from: tied embeddings load `output` from tok_embeddings."""
        if self.args.tie_word_embeddings and param_name == "output.weight":
            return "tok_embeddings.weight"
        return param_name

    def materialize(self, device: torch.device, dtype: torch.dtype) -> "Transformer":
        """Give the meta-device parameters real (uninitialised) storage, and compute the rotary table."""
        self.to(dtype).to_empty(device=device)  # the dtype change is free on the meta device
        freqs = rope_frequencies(self.args.head_dim, self.args.rope_theta, self.rope_scaling)
        self.rotations = rope_table(freqs, self.args.max_seq_len, device)
        return self

    @property
    def rope_scaling(self):
        if self.args.use_scaled_rope and self.args.rope_scaling is None:
            return {"rope_type": "llama3", "factor": 8.0}  # Meta's LLaMA-3.1 defaults
        return self.args.rope_scaling

    def setup_caches(self, rows: int, columns: int) -> None:
        """Make sure every layer has a KV cache of at least `rows` sequences of `columns` positions; reuse the
        current one if it fits."""
        if columns > self.args.max_seq_len:
            raise ValueError(f"{columns} positions requested; the model was set up for max_seq_len "
                             f"{self.args.max_seq_len}")
        first = self.layers[0].attention.cache
        if first is not None and first.k.shape[0] >= rows and first.k.shape[2] >= columns:
            return
        self.free_caches()  # before allocating, so the old and new never coexist
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            attn = layer.attention
            attn.cache = KVCache(rows, attn.n_local_kv_heads, columns, attn.head_dim, weight.dtype, weight.device)

    def free_caches(self) -> None:
        for layer in self.layers:
            layer.attention.cache = None

    @property
    def cache_nbytes(self) -> int:
        return sum(layer.attention.cache.nbytes for layer in self.layers if layer.attention.cache is not None)

    def move_cache_rows(self, dst: list[int], src: list[int], end: int) -> None:
        for layer in self.layers:
            layer.attention.cache.move_rows(dst, src, end)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache_rows: Optional[slice] = None, logits_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits for tokens (B, L): (B, L, vocab), or (B, vocab) at index `logits_at` (B,) of each row.

        `positions` (B, L): each token's position (default 0..L-1 for every row, causal). With `cache_rows`, the
        keys and values are written to those KV-cache rows at those positions, and each token also sees the
        earlier positions cached there; without, nothing is cached (scoring).
        """
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        rotations = self.rotations[:seqlen][None] if positions is None else self.rotations[positions]
        end = seqlen if positions is None else int(positions.max()) + 1
        at = CacheAt(cache_rows, positions, end) if cache_rows is not None else None
        mask = attention_mask(positions, end)
        for layer in self.layers:
            h = layer(h, rotations, mask, at)
        if logits_at is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_at]
        return self.output(self.norm(h)).float()
