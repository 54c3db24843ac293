"""Shared LLaMA-family blocks: RMSNorm, rotary embeddings, the KV cache, attention and the SwiGLU feed-forward.

Model files (model/LLM/<type>.py) only wire these; there is one implementation of each idea.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from accessory.errors import ConfigError
from accessory.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (bf16 loses too much in the mean of squares), scale in the input dtype, as Meta does.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float, scaling: Union[None, float, dict]) -> torch.Tensor:
    """Per-pair rotation frequencies (head_dim / 2,), float32, with linear or llama3 scaling applied."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return freqs
    if isinstance(scaling, (int, float)):  # LLaMA2-Accessory's form: a linear position-interpolation factor
        scaling = {"rope_type": "linear", "factor": float(scaling)}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return freqs / scaling["factor"]  # same as dividing positions by the factor
    if kind == "llama3":
        return _llama3_scaled(freqs, scaling["factor"], scaling.get("low_freq_factor", 1.0),
                              scaling.get("high_freq_factor", 4.0),
                              scaling.get("original_max_position_embeddings", 8192))
    raise ConfigError(f"unknown rope_scaling type {kind!r} in {scaling}; known: 'linear', 'llama3'")


def _llama3_scaled(freqs, factor, low_freq_factor, high_freq_factor, old_context_len) -> torch.Tensor:
    # Meta's LLaMA-3.1 rule: keep short wavelengths, divide long ones by `factor`, blend smoothly in between.
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_context_len / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < old_context_len / high_freq_factor, freqs, out)


def rope_table(freqs: torch.Tensor, max_seq_len: int, device: torch.device) -> torch.Tensor:
    """Complex rotations for positions 0..max_seq_len-1: (max_seq_len, head_dim / 2), complex64."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs).to(device)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate Meta-style interleaved pairs (x[2i], x[2i+1]). x: (B, L, H, D); rotations: (B or 1, L, D / 2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, L, H, D/2)
    rotated = pairs * rotations[:, :, None, :]
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class KVCache(nn.Module):
    """Preallocated keys and values for one attention layer: (rows, n_local_kv_heads, columns, head_dim).

    A row holds one sequence; its token at RoPE position p lives in column p, so rows at different positions
    share the cache (continuous batching) and no row ever needs padding.
    """

    def __init__(self, rows: int, n_kv_heads: int, columns: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (rows, n_kv_heads, columns, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, at: "CacheAt", k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, H, L, D) for the rows and positions `at` names; return those rows' keys and values up to
        the last position written: (B, H, end, D)."""
        rows = at.rows
        if at.positions is None:  # every row from position 0
            self.k[rows, :, :k.shape[2]] = k
            self.v[rows, :, :k.shape[2]] = v
        else:
            index = torch.arange(rows.start, rows.stop, device=k.device)[:, None]
            self.k[index, :, at.positions] = k.transpose(1, 2)  # advanced indices first: (B, L, H, D)
            self.v[index, :, at.positions] = v.transpose(1, 2)
        return self.k[rows, :, :at.end], self.v[rows, :, :at.end]

    def move_rows(self, dst: list[int], src: list[int], end: int) -> None:
        """Copy rows `src` to rows `dst` (columns up to `end`): a finished row's place is filled by a live one."""
        if dst:
            dst_index, src_index = torch.tensor(dst), torch.tensor(src)
            self.k[dst_index, :, :end] = self.k[src_index, :, :end]
            self.v[dst_index, :, :end] = self.v[src_index, :, :end]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True)
class CacheAt:
    """Where a forward pass reads and writes the KV cache: cache rows `rows` (one per batch row), at `positions`
    (B, L) (None: 0..L-1 for every row); `end` is one past the last position written."""
    rows: slice
    positions: Optional[torch.Tensor]
    end: int


@dataclass(frozen=True)
class Linears:
    """The linear layer classes a block is built from: (in_features, out_features, ctx, ...) -> module. Plain
    fairscale-style layers for llama; LoRA- and bias-capable ones for llama_peft (parallel/lora.py)."""
    column: Callable[..., nn.Module] = ColumnParallelLinear
    row: Callable[..., nn.Module] = RowParallelLinear


PLAIN = Linears()


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ctx: ParallelContext, linears: Linears = PLAIN):
        super().__init__()
        self.head_dim = dim // n_heads
        # KV heads are split across ranks when they are at least as many as the ranks; otherwise each rank holds a
        # copy of the one KV head its query heads use (ranks r*n_kv/world.. share it), so GQA still works.
        kv_parts = min(ctx.world_size, n_kv_heads)
        self.n_local_heads = n_heads // ctx.world_size
        self.n_local_kv_heads = n_kv_heads // kv_parts
        self.wq = linears.column(dim, n_heads * self.head_dim, ctx)
        self.wk = linears.column(dim, n_kv_heads * self.head_dim, ctx, parts=kv_parts)
        self.wv = linears.column(dim, n_kv_heads * self.head_dim, ctx, parts=kv_parts)
        self.wo = linears.row(n_heads * self.head_dim, dim, ctx)
        self.cache: Optional[KVCache] = None  # set by Transformer.setup_caches; used when forward is given `at`

    def forward(self, x: torch.Tensor, rotations: torch.Tensor, mask: Optional[torch.Tensor] = None,
                at: Optional[CacheAt] = None) -> torch.Tensor:
        batch, seqlen, _ = x.shape
        q = apply_rope(self.wq(x).view(batch, seqlen, self.n_local_heads, self.head_dim), rotations)
        k = apply_rope(self.wk(x).view(batch, seqlen, self.n_local_kv_heads, self.head_dim), rotations)
        v = self.wv(x).view(batch, seqlen, self.n_local_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, D)
        if at is not None:
            k, v = self.cache.update(at, k, v)  # (B, H_kv, end, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                             is_causal=mask is None and seqlen > 1)
        return self.wo(out.transpose(1, 2).reshape(batch, seqlen, -1))


def attention_mask(positions: Optional[torch.Tensor], end: int) -> Optional[torch.Tensor]:
    """Which cache columns each query may see (True = may attend): columns up to its own position.

    `positions` (B, L) are the queries' positions, None when every row runs 0..L-1 (SDPA's own causal flag then
    does the job). Returns (B, 1, L, end) bool, or None.
    """
    if positions is None:
        return None
    columns = torch.arange(end, device=positions.device)
    return (columns[None, None, :] <= positions[:, :, None]).unsqueeze(1)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), hidden units split across ranks."""

    def __init__(self, dim: int, hidden_dim: int, ctx: ParallelContext, linears: Linears = PLAIN):
        super().__init__()
        self.w1 = linears.column(dim, hidden_dim, ctx)
        self.w2 = linears.row(hidden_dim, dim, ctx)
        self.w3 = linears.column(dim, hidden_dim, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
