"""Shared LLaMA-family blocks: RMSNorm, rotary embeddings, the KV cache, attention and the SwiGLU feed-forward.

Model files (model/LLM/<type>.py) only wire these; there is one implementation of each idea.

Attention runs three ways, all on the same weights:
- `forward`: whole sequences from position 0, nothing cached (scoring);
- `prefill`: several prompts packed into one sequence, each written into its own KV-cache row, each attending only
  to itself and to what its row already holds before it (a reused prefix); no padding is ever computed;
- `decode`: one new token per cache row, at each row's own position, attending over the first `columns` cache
  columns through a mask. Its shapes depend only on the batch's row count and the column bucket, never on data, and
  it syncs nothing with the host, so the engine can compile it (and capture it as a CUDA graph).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from accessory.errors import ConfigError
from accessory.kernels import decode_attention
from accessory.parallel import ColumnParallelLinear, FusedColumns, ParallelContext, RowParallelLinear
from accessory.quant.formats import GROUP


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
    """Rotations for positions 0..max_seq_len-1: (max_seq_len, head_dim / 2, 2) float32, [cos, sin] last.

    Real-valued (not complex), so the compiler can fuse it."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).to(device)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate Meta-style interleaved pairs (x[2i], x[2i+1]) by angle a_i: (x0 cos - x1 sin, x0 sin + x1 cos).

    x: (B, L, H, D); rotations: (B or 1, L, D / 2, 2) from `rope_table`."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, L, H, D/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = rotations[:, :, None, :, 0], rotations[:, :, None, :, 1]  # (B, L, 1, D/2)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(3).type_as(x)


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

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, H, D) of N tokens at cache rows `rows` (N,) and columns `positions` (N,)."""
        self.k[rows, :, positions] = k  # the advanced indices come first: (N, H, D)
        self.v[rows, :, positions] = v

    def move_rows(self, dst: list[int], src: list[int], end: int) -> None:
        """Copy rows `src` to rows `dst` (columns up to `end`): a finished row's place is filled by a live one, a
        finished row is kept for reuse, a prompt takes a cached prefix."""
        if dst:
            dst_index, src_index = torch.tensor(dst), torch.tensor(src)
            self.k[dst_index, :, :end] = self.k[src_index, :, :end]
            self.v[dst_index, :, :end] = self.v[src_index, :, :end]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True)
class Segment:
    """One prompt in a packed prefill: tokens[start:start + length] go to KV-cache row `row`, columns past..past +
    length - 1, and attend to that row's columns 0..past - 1 too (a prefix already in the cache, not recomputed)."""
    start: int
    length: int
    row: int
    past: int = 0


def prefill_mask(past: int, length: int, device: torch.device):
    """None for a prompt from column 0 (plain causal attention); else (length, past + length) bool: new token i
    sees columns 0..past + i. (SDPA's is_causal aligns to the top left, which is wrong once past > 0.)"""
    if past == 0:
        return None
    return torch.arange(past + length, device=device) <= torch.arange(past, past + length, device=device)[:, None]


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
        self.wqkv: FusedColumns | None = None  # wq, wk, wv as one product, once `fuse` has run
        self.cache: KVCache | None = None  # set by Transformer.setup_caches; used by prefill and decode

    def fuse(self) -> None:
        """Compute q, k and v in one product (materialized, before loading): one call instead of three."""
        if FusedColumns.fusable([self.wq, self.wk, self.wv]):
            self.wqkv = FusedColumns([self.wq, self.wk, self.wv])

    def _qkv(self, x: torch.Tensor, rotations: torch.Tensor):
        """q (B, L, H, D), k and v (B, L, H_kv, D), with RoPE applied to q and k."""
        batch, seqlen, _ = x.shape
        q, k, v = self.wqkv(x) if self.wqkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        q = apply_rope(q.view(batch, seqlen, self.n_local_heads, self.head_dim), rotations)
        k = apply_rope(k.view(batch, seqlen, self.n_local_kv_heads, self.head_dim), rotations)
        return q, k, v.view(batch, seqlen, self.n_local_kv_heads, self.head_dim)

    def _out(self, attended: torch.Tensor) -> torch.Tensor:
        """attended (B, H, L, D) -> the block's output (B, L, dim)."""
        batch, _, seqlen, _ = attended.shape
        return self.wo(attended.transpose(1, 2).reshape(batch, seqlen, -1))

    def forward(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences (B, L, dim) from position 0; nothing cached."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, rotations))
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=x.shape[1] > 1, enable_gqa=True))

    def prefill(self, x: torch.Tensor, rotations: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                segments: list[Segment], masks: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Packed prompts x (1, T, dim): token t goes to cache row rows[t], column positions[t]; each segment is
        one prompt, causal within itself and seeing its row's cached columns before it (its `prefill_mask`)."""
        q, k, v = self._qkv(x, rotations)  # (1, T, H, D)
        self.cache.write(rows, positions, k[0], v[0])
        q = q.transpose(1, 2)  # (1, H, T, D)
        attended = []
        for seg, mask in zip(segments, masks):  # keys and values from the cache: the prefix's and its own
            end = seg.past + seg.length
            keys, values = self.cache.k[seg.row:seg.row + 1, :, :end], self.cache.v[seg.row:seg.row + 1, :, :end]
            attended.append(F.scaled_dot_product_attention(q[:, :, seg.start:seg.start + seg.length], keys, values,
                                                           attn_mask=mask, is_causal=mask is None, enable_gqa=True))
        return self._out(torch.cat(attended, dim=2))

    def decode(self, x: torch.Tensor, rotations: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """One token per cache row 0..B-1, x (B, 1, dim), at `positions` (B,); `mask` (B, 1, 1, C) says which of
        the first C cache columns each row sees."""
        batch = x.shape[0]
        q, k, v = self._qkv(x, rotations)
        rows = torch.arange(batch, device=x.device)
        self.cache.write(rows, positions, k[:, 0], v[:, 0])
        attended = decode_attention(q, self.cache.k, self.cache.v, positions, mask)
        return self._out(attended)


def decode_mask(positions: torch.Tensor, columns: int) -> torch.Tensor:
    """(B, 1, 1, columns) bool: True where a row at `positions` (B,) may attend, i.e. columns up to its own."""
    return (torch.arange(columns, device=positions.device) <= positions[:, None])[:, None, None, :]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), hidden units split across ranks."""

    def __init__(self, dim: int, hidden_dim: int, ctx: ParallelContext, linears: Linears = PLAIN):
        super().__init__()
        self.w1 = linears.column(dim, hidden_dim, ctx)
        self.w2 = linears.row(hidden_dim, dim, ctx)
        self.w3 = linears.column(dim, hidden_dim, ctx)
        self.w13: FusedColumns | None = None  # w1 and w3 as one product, once `fuse` has run

    def fuse(self) -> None:
        """Compute w1 x and w3 x in one product (materialized, before loading)."""
        if FusedColumns.fusable([self.w1, self.w3]):
            self.w13 = FusedColumns([self.w1, self.w3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x) if self.w13 is not None else (self.w1(x), self.w3(x))
        return self.w2(F.silu(gate) * up)

    def align_hidden(self) -> None:
        """Split the hidden units on quantization-group boundaries: w2's inputs are quantized in groups of 32, and
        w1's and w3's outputs must be split as w2's inputs are (meta device, before loading)."""
        for layer in (self.w1, self.w2, self.w3):
            layer.align_(GROUP)
