"""Shared decoder blocks of every family: RMSNorm (with Gemma's +1 offset or without), rotary embeddings (linear,
llama3 and yarn scaling), attention on a KV cache (kv_caches.py; whole, or a ring holding a sliding window; optional qkv bias,
per-head q/k norm, a query scale, a sliding window), the gated feed-forward (SiLU or GELU-tanh) and the mixture of
experts (a router over gated feed-forwards, the experts spread over ranks).

Model files (network/LLM/<type>.py) only wire these; there is one implementation of each idea. The blocks read what
they need from the family's ModelArgs (`args`): sizes, and its traits (`qkv_bias`, `qk_norm`, `norm_offset`, ...).

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
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from accessory.errors import ConfigError
from accessory.kernels import (apply_rope, attends_in_one_call, decode_attention, expert_product, gated,
                               grouped_experts, products_in_one_call, rms_norm)
from accessory.kernels.build import one_row_float_kernel
from accessory.parallel import (ColumnParallelLinear, ExpertLinear, FusedColumns, ParallelContext, RowParallelLinear,
                                expert_placement, head_placement, head_shard)
from accessory.network.config import LLAMA3_ROPE_DEFAULTS, MoEConfig
from accessory.network.kv_caches import KVCache
from accessory.quant.formats import GROUP, PARTS, block_size
from accessory.parallel.quantized_weight import QuantizedWeight


class RMSNorm(nn.Module):
    """x / rms(x) * weight; with `offset` (Gemma's 1.0), x / rms(x) * (offset + weight), as Gemma stores its norms."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


ROPE_TYPES = ("linear", "llama3", "yarn")




def rope_frequencies(head_dim: int, theta: float, scaling: Union[None, float, dict]) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies (head_dim / 2,), float32, with linear, llama3 or yarn scaling applied; and the
    factor yarn scales cos and sin by (1.0 otherwise)."""
    freqs = base_frequencies(head_dim, theta)
    if scaling is None:
        return freqs, 1.0
    if isinstance(scaling, (int, float)):  # LLaMA2-Accessory's form: a linear position-interpolation factor
        scaling = {"rope_type": "linear", "factor": float(scaling)}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return freqs / scaling["factor"], 1.0  # same as dividing positions by the factor
    if kind == "llama3":
        return llama3_scaled(freqs, **{**LLAMA3_ROPE_DEFAULTS, **{k: v for k, v in scaling.items()
                                                                  if k in LLAMA3_ROPE_DEFAULTS}}), 1.0
    if kind == "yarn":
        return _yarn_scaled(freqs, theta, scaling)
    raise ConfigError(f"unknown rope_scaling type {kind!r} in {scaling}; known: {list(ROPE_TYPES)}")


def base_frequencies(head_dim: int, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))


def llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position_embeddings: int) -> torch.Tensor:
    """Meta's LLaMA-3.1 rule: keep short wavelengths, divide long ones by `factor`, blend smoothly in between."""
    old_context_len = original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > old_context_len / low_freq_factor, freqs / factor, blended)
    return torch.where(wavelen < old_context_len / high_freq_factor, freqs, out)


def _yarn_scaled(freqs: torch.Tensor, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    # YaRN (Qwen2.5's long-context setting), as transformers computes it: frequencies that turn fewer than
    # beta_slow times over the original context are interpolated (divided by factor), those turning more than
    # beta_fast times are kept, with a linear ramp between; cos and sin are scaled by the attention factor.
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    dim = 2 * freqs.numel()

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = (mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]) if both
                     else mscale(factor))

    def turns_to_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_to_dim(scaling.get("beta_fast") or 32), turns_to_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return freqs / factor * (1 - keep) + freqs * keep, float(attention)


def rope_table(freqs: torch.Tensor, max_seq_len: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Rotations for positions 0..max_seq_len-1: (max_seq_len, head_dim / 2, 2) float32, [cos, sin] last (times
    `scale`: yarn's attention factor).

    Real-valued (not complex), so the compiler can fuse it."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return (torch.stack((angles.cos(), angles.sin()), dim=-1) * scale).to(device)


@dataclass(frozen=True)
class Segment:
    """One prompt in a packed prefill: tokens[start:start + length] go to KV-cache row `row`, columns past..past +
    length - 1, and attend to that row's columns 0..past - 1 too (a prefix already in the cache, not recomputed).
    `adapter`: the PEFT adapter the row runs with (serving's --lora-modules; 0: the base model)."""
    start: int
    length: int
    row: int
    past: int = 0
    adapter: int = 0


def prefill_mask(past: int, length: int, device: torch.device):
    """None for a prompt from column 0 (plain causal attention); else (length, past + length) bool: new token i
    sees columns 0..past + i. (SDPA's is_causal aligns to the top left, which is wrong once past > 0.)"""
    if past == 0:
        return None
    return torch.arange(past + length, device=device) <= torch.arange(past, past + length, device=device)[:, None]


def window_mask(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """(len(queries), len(keys)) bool: a query at position q sees keys at positions q - window + 1 .. q."""
    return (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)


@dataclass(frozen=True)
class WindowPrefill:
    """What a sliding-window layer needs for one segment of a packed prefill, the same in every such layer: the
    ring columns holding the row's last positions before `past` (in position order), and the mask over those and
    the segment's own tokens."""
    columns: torch.Tensor  # (held,) ring columns
    mask: Optional[torch.Tensor]  # (length, held + length) bool; None: plain causal (nothing held, all in the window)
    keep: int  # the segment's last `keep` tokens are written to the ring (the others fall out of the window)


def window_prefill(seg: Segment, window: int, ring_columns: int, device: torch.device) -> WindowPrefill:
    held = min(seg.past, ring_columns)
    past_positions = torch.arange(seg.past - held, seg.past, device=device)
    new_positions = torch.arange(seg.past, seg.past + seg.length, device=device)
    causal = held == 0 and seg.length <= window  # SDPA's is_causal skips the masked half's work
    mask = None if causal else window_mask(new_positions, torch.cat((past_positions, new_positions)), window)
    return WindowPrefill(past_positions % ring_columns, mask, min(seg.length, ring_columns))


@dataclass(frozen=True)
class Linears:
    """The linear layer classes a block is built from: (in_features, out_features, ctx, ...) -> module. Plain
    fairscale-style layers for llama; LoRA- and bias-capable ones for llama_peft (parallel/lora.py)."""
    column: Callable[..., nn.Module] = ColumnParallelLinear
    row: Callable[..., nn.Module] = RowParallelLinear


PLAIN = Linears()


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads, split across ranks by heads. `window`: a sliding-window layer
    (each token sees the last `window` positions, itself included). The family's traits: `args.qkv_bias` (Qwen2),
    `args.qk_norm` (an RMSNorm over each head's q and k before RoPE: Qwen3, Gemma 3), `args.attention_scale`."""

    def __init__(self, args, ctx: ParallelContext, linears: Linears = PLAIN, window: Optional[int] = None):
        super().__init__()
        dim, n_heads, n_kv_heads, self.head_dim = args.dim, args.n_heads, args.n_kv_heads, args.head_dim
        self.window = window
        # Each rank holds whole GQA groups (unevenly where the ranks do not divide them); when ranks outnumber KV
        # heads, a copy of the one KV head its query heads use, so GQA still works (parallel/layers.py).
        place = head_placement(n_heads, n_kv_heads, ctx.world_size, ctx.rank)
        self.n_local_heads, self.n_local_kv_heads = len(place.heads), len(place.kv_heads)
        q_rows = head_shard(0, place.heads, n_heads, self.head_dim)
        kv_rows = head_shard(0, place.kv_heads, n_kv_heads, self.head_dim)
        bias = {"bias": True} if args.qkv_bias else {}
        self.wq = linears.column(dim, n_heads * self.head_dim, ctx, shard=q_rows, **bias)
        self.wk = linears.column(dim, n_kv_heads * self.head_dim, ctx, shard=kv_rows, **bias)
        self.wv = linears.column(dim, n_kv_heads * self.head_dim, ctx, shard=kv_rows, **bias)
        self.wo = linears.row(n_heads * self.head_dim, dim, ctx, shard=replace(q_rows, dim=1))  # q's heads, as inputs
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset)
        # SDPA and the kernels scale by head_dim ** -0.5; another scale is applied to q first
        self.q_scale = args.attention_scale * self.head_dim ** 0.5
        self.wqkv: FusedColumns | None = None  # wq, wk, wv as one product, once `fuse` has run

    def fuse(self) -> None:
        """Compute q, k and v in one product (materialized, before loading): one call instead of three."""
        if FusedColumns.fusable([self.wq, self.wk, self.wv]):
            self.wqkv = FusedColumns([self.wq, self.wk, self.wv])

    def _project(self, x: torch.Tensor):
        """q (B, L, H * D), k and v (B, L, H_kv * D): x's projections, as they come."""
        return self.wqkv(x) if self.wqkv is not None else (self.wq(x), self.wk(x), self.wv(x))

    def _qkv(self, x: torch.Tensor, rotations: torch.Tensor):
        """q (B, L, H, D), k and v (B, L, H_kv, D), with q/k norm and RoPE applied to q and k."""
        batch, seqlen, _ = x.shape
        q, k, v = self._project(x)
        q = q.view(batch, seqlen, self.n_local_heads, self.head_dim)
        k = k.view(batch, seqlen, self.n_local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k = apply_rope(q, rotations), apply_rope(k, rotations)
        return q, k, v.view(batch, seqlen, self.n_local_kv_heads, self.head_dim)

    def _out(self, attended: torch.Tensor) -> torch.Tensor:
        """attended (B, H, L, D) -> the block's output (B, L, dim)."""
        batch, _, seqlen, _ = attended.shape
        return self.wo(attended.transpose(1, 2).reshape(batch, seqlen, -1))

    def forward(self, x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """Causal attention over whole sequences (B, L, dim) from position 0; nothing cached."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, rotations))
        length = x.shape[1]
        if self.window is not None and length > self.window:
            positions = torch.arange(length, device=x.device)
            mask = window_mask(positions, positions, self.window)
            return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, enable_gqa=True))

    def prefill(self, x: torch.Tensor, rotations: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                segments: list[Segment], masks: list, cache: KVCache) -> torch.Tensor:
        """Packed prompts x (1, T, dim): token t goes to `cache` row rows[t], position positions[t]; each segment is
        one prompt, causal within itself and seeing its row's cached positions before it: `masks` are the
        segments' `prefill_mask`s, or on a sliding-window layer their `WindowPrefill`s."""
        q, k, v = self._qkv(x, rotations)  # (1, T, H, D)
        if self.window is not None:
            return self._window_prefill(q, k[0], v[0], segments, masks, cache)
        cache.write(rows, positions, k[0], v[0])
        q = q.transpose(1, 2)  # (1, H, T, D)
        attended = []
        for seg, mask in zip(segments, masks):  # keys and values from the cache: the prefix's and its own
            end = seg.past + seg.length
            keys, values = cache.k[seg.row:seg.row + 1, :, :end], cache.v[seg.row:seg.row + 1, :, :end]
            attended.append(F.scaled_dot_product_attention(q[:, :, seg.start:seg.start + seg.length], keys, values,
                                                           attn_mask=mask, is_causal=mask is None, enable_gqa=True))
        return self._out(torch.cat(attended, dim=2))

    def _window_prefill(self, q, k, v, segments: list[Segment], plans: list[WindowPrefill],
                        cache: KVCache) -> torch.Tensor:
        """Each segment attends to the positions its row's ring still holds and to its own keys (from k, v (T, H_kv,
        D), not the ring: a long prompt overwrites the ring's columns while its first tokens still need them); then
        its last positions are written to the ring."""
        q, attended = q.transpose(1, 2), []  # (1, H, T, D)
        for seg, plan in zip(segments, plans):
            own = slice(seg.start, seg.start + seg.length)
            keys = torch.cat((cache.k[seg.row, :, plan.columns], k[own].transpose(0, 1)), dim=1)[None]
            values = torch.cat((cache.v[seg.row, :, plan.columns], v[own].transpose(0, 1)), dim=1)[None]
            attended.append(F.scaled_dot_product_attention(q[:, :, own], keys, values, attn_mask=plan.mask,
                                                           is_causal=plan.mask is None, enable_gqa=True))
        for seg, plan in zip(segments, plans):
            last = slice(seg.start + seg.length - plan.keep, seg.start + seg.length)
            positions = torch.arange(seg.past + seg.length - plan.keep, seg.past + seg.length, device=k.device)
            cache.write(torch.full_like(positions, seg.row), positions, k[last], v[last])
        return self._out(torch.cat(attended, dim=2))

    def decode(self, x: torch.Tensor, rotations: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        """L new tokens per `cache` row 0..B-1, x (B, L, dim), at `positions` (B, L) (L is 1 but when verifying
        speculative proposals); `mask` (B, 1, L, C) says which of the first C cache columns each token sees (on a
        ring, where L is 1: which of its columns hold positions already written)."""
        batch, length = positions.shape
        if attends_in_one_call(x, cache.k, cache.ring):
            products = [self.wqkv and self.wqkv.plain_parts(), self.wo.plain_parts()]
            if products_in_one_call(x, products):
                return self.wo.ctx.all_reduce(self._block(x, products, rotations, positions, cache))
            return self.wo(self._attend(*self._project(x), rotations, positions, cache))
        q, k, v = self._qkv(x, rotations)
        rows = torch.arange(batch, device=x.device)[:, None].expand(batch, length)
        cache.write(rows.reshape(-1), positions.reshape(-1), k.flatten(0, 1), v.flatten(0, 1))
        if cache.ring:  # every column holds one of the last `columns` positions, once written
            positions = positions.clamp(max=cache.columns - 1)
        attended = decode_attention(q, cache.k, cache.v, positions, mask, cache.ring)
        return self._out(attended)


    def _attend(self, q, k, v, rotations, positions, cache: KVCache) -> torch.Tensor:
        """decode's steps from the projections to the attention's output (B, L, H * D) in one kernel call."""
        return torch.ops.accessory.attend_cpu(q, k, v, rotations, positions, cache.k, cache.v, cache.ring,
                                              self.q_scale, *self._qk_norms())

    def _block(self, x, products, rotations, positions, cache: KVCache) -> torch.Tensor:
        """decode from x to this rank's partial sum (B, L, dim), all-reduce aside, in one kernel call."""
        (qkv_fmt, qkv), (out_fmt, out) = products
        return torch.ops.accessory.attention_block_cpu(
            x, qkv_fmt, qkv, self.wqkv.bias, rotations, positions, cache.k, cache.v, cache.ring,
            self.q_scale, *self._qk_norms(), out_fmt, out, one_row_float_kernel())

    def _qk_norms(self) -> tuple:
        if self.q_norm is None:
            return None, None, 0.0, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset


def decode_mask(positions: torch.Tensor, columns: int) -> torch.Tensor:
    """(B, 1, L, columns) bool: True where a token at `positions` (B, L), or (B,) for L = 1, may attend, i.e. its
    row's columns up to its own position."""
    visible = torch.arange(columns, device=positions.device) <= positions[..., None]  # (B, [L,] columns)
    return visible.view(positions.shape[0], 1, -1, columns)


class FeedForward(nn.Module):
    """A gated MLP, w2(act(w1 x) * w3 x), hidden units split across ranks: SwiGLU (act silu: LLaMA, Qwen, Mistral)
    or GeGLU (gelu_tanh: Gemma). The hidden units are split evenly whatever the heads' split: the attention and the
    FFN each end in an all-reduce, each waited for by the faster ranks, so moving units to the ranks with fewer
    heads would add a wait at the FFN's all-reduce without taking one from the attention's."""

    def __init__(self, dim: int, hidden_dim: int, ctx: ParallelContext, linears: Linears = PLAIN,
                 activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.w1 = linears.column(dim, hidden_dim, ctx)
        self.w2 = linears.row(hidden_dim, dim, ctx)
        self.w3 = linears.column(dim, hidden_dim, ctx)
        self.w13: FusedColumns | None = None  # w1 and w3 as one product, once `fuse` has run

    def fuse(self) -> None:
        """Compute w1 x and w3 x in one product (materialized, before loading)."""
        if FusedColumns.fusable([self.w1, self.w3]):
            self.w13 = FusedColumns([self.w1, self.w3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = [self.w13 and self.w13.plain_parts(), self.w2.plain_parts()]
        if products_in_one_call(x, products):  # an eager step's few rows: the whole MLP in one kernel call
            (w13_fmt, w13), (w2_fmt, w2) = products
            return self.w2.ctx.all_reduce(torch.ops.accessory.mlp_block_cpu(x, w13_fmt, w13, self.activation, w2_fmt,
                                                                             w2, one_row_float_kernel()))
        gate, up = self.w13(x) if self.w13 is not None else (self.w1(x), self.w3(x))
        return self.w2(gated(gate, up, self.activation))

    def align_hidden(self, block: int = GROUP) -> None:
        """Split the hidden units on quantization-block boundaries: w2's inputs are quantized in blocks of `block`
        (w2's format's: formats.block_size, 32 for int8 / int4, 256 for GGUF's K types), and w1's and w3's outputs
        must be split as w2's inputs are (meta device, before loading)."""
        for layer in (self.w1, self.w2, self.w3):
            layer.align_(block)

    def linear_names(self) -> list[str]:
        """The names (under the block's `feed_forward.`) of its weights that quantization covers."""
        return ["w1", "w2", "w3"]

    def align_for(self, formats: dict[str, str], prefix: str) -> None:
        """Before quantizing to `formats` (weight name -> format): split the hidden units on w2's blocks."""
        if any(f"{prefix}{w}.weight" in formats for w in ("w1", "w2", "w3")):
            w2 = formats.get(f"{prefix}w2.weight")
            self.align_hidden(block_size(w2) if w2 else GROUP)

    def held_elsewhere(self) -> list[str]:
        """Checkpoint names (under `feed_forward.`) of weights that other ranks hold and this one does not."""
        return []


class Expert(nn.Module):
    """One expert's w1, w2, w3 (this rank's slice of its hidden units): the weights only, multiplied stacked."""

    def __init__(self, dim: int, hidden_dim: int, parts: int, part: int):
        super().__init__()
        self.w1 = ExpertLinear(dim, hidden_dim, 0, parts, part)
        self.w2 = ExpertLinear(hidden_dim, dim, 1, parts, part)
        self.w3 = ExpertLinear(dim, hidden_dim, 0, parts, part)


class ExpertStack(nn.Module):
    """The same weight of every local expert stacked, (experts, out, in) float or its quantized parts, and the
    experts' own weights made views of it (materialized, before loading: nothing is copied, and loading and saving
    see each expert's weight under its own name). `groups[e]`: expert e's layers whose rows are stacked one after
    another (w1 and w3: one product)."""

    def __init__(self, groups: list[list[ExpertLinear]]):
        super().__init__()
        first = groups[0][0].weight
        self.fmt = first.fmt if isinstance(first, QuantizedWeight) else None
        self.names = PARTS[self.fmt] if self.fmt else ("weight",)
        sizes = [layer.weight.shape[0] for layer in groups[0]]
        for name in self.names:
            def tensor(layer):
                return layer.weight.parts[name] if self.fmt else layer.weight.data
            stacked = torch.stack([torch.cat([tensor(layer) for layer in group]) for group in groups])
            self.register_buffer(name, stacked, persistent=False)
            for e, group in enumerate(groups):
                for layer, view in zip(group, stacked[e].split(sizes)):
                    if self.fmt:
                        setattr(layer.weight, name, view)
                    else:
                        layer.weight = nn.Parameter(view, requires_grad=False)

    def parts(self) -> list[torch.Tensor]:
        """The stacked tensors, in the format's PARTS order (the float weight alone)."""
        return [getattr(self, name) for name in self.names]

    def product(self, x: torch.Tensor, expert: Union[int, torch.Tensor]) -> torch.Tensor:
        """x (..., in) @ W_e^T for local expert `expert`: an int, or a (1,) tensor (kernels' `expert_product`)."""
        return expert_product(x, self.fmt, self.parts(), expert)


class MoEFeedForward(nn.Module):
    """A mixture of experts (Mixtral, Qwen3-MoE): a router (`gate`, experts x dim, whole on every rank) picks the top
    k experts of each token, and the token's output is the router-weighted sum of those experts' gated MLPs.

    The experts are spread over the ranks by `expert_placement` (whole experts per rank when the ranks divide them,
    their hidden units split otherwise); each rank computes its experts' share and one all-reduce sums the shares.
    `experts` is keyed by global expert id, as LLaMA2-Accessory's checkpoints name them
    (`layers.N.feed_forward.experts.E.w1.weight`).

    Only the chosen experts' weights are read:
    - grouped (eager, and compiled on the CPU): tokens are grouped by expert, one product per chosen expert on its
      tokens (kernels' `grouped_experts`; under torch.compile an operator, so the grouping's sizes stay data);
    - static (a GPU's compiled or CUDA-graph-captured step): no host sync and shapes fixed by the row count. When a
      step's T tokens make fewer than `local experts` choices (T * k < L: batch-1 decode), each choice's weights are
      gathered by id (k experts read, not L); otherwise every local expert runs on every token, weighted by the
      router (0 for tokens that did not choose it), which reads each weight once, as a batch would anyway.
    """

    def __init__(self, dim: int, hidden_dim: int, moe: MoEConfig, ctx: ParallelContext, activation: str = "silu"):
        super().__init__()
        self.ctx, self.moe, self.activation = ctx, moe, activation
        self.placement = expert_placement(moe.num_experts, ctx.world_size, ctx.rank)
        self.gate = ColumnParallelLinear(dim, moe.num_experts, ctx, parts=1)  # parts=1: whole on every rank
        self.experts = nn.ModuleDict({str(e): Expert(dim, hidden_dim, self.placement.parts, self.placement.part)
                                      for e in self.placement.experts})
        self.w13: ExpertStack | None = None  # the local experts' [w1; w3], (L, 2 * local hidden, dim), once fused
        self.w2: ExpertStack | None = None  # their w2, (L, dim, local hidden)

    def fuse(self) -> None:
        """Stack the local experts' weights (materialized, before loading)."""
        experts = list(self.experts.values())
        self.w13 = ExpertStack([[e.w1, e.w3] for e in experts])
        self.w2 = ExpertStack([[e.w2] for e in experts])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For tokens x (T, dim): the router weights (T, k) in x's dtype, 0 for an expert another rank holds, and
        the chosen experts' local indices (T, k), L (the local expert count) for one held elsewhere. The softmax
        is in float32, over all experts, as transformers computes it."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.moe.num_experts_per_tok, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        local, count = ids - self.placement.experts.start, len(self.placement.experts)
        here = (local >= 0) & (local < count)
        return torch.where(here, weights.to(x.dtype), 0), torch.where(here, local, count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (T, dim)
        weights, local = self.route(flat)
        static = x.is_cuda and (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing())
        y = self._static(flat, weights, local) if static else self._grouped(flat, weights, local)
        return self.ctx.all_reduce(y).reshape(x.shape)

    def _mlp(self, x: torch.Tensor, expert: Union[int, torch.Tensor]) -> torch.Tensor:
        gate, up = self.w13.product(x, expert).chunk(2, dim=-1)
        return self.w2.product(gated(gate, up, self.activation), expert)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """One product per local expert on the tokens that chose it."""
        grouped = torch.ops.accessory.grouped_experts if torch.compiler.is_compiling() else grouped_experts
        return grouped(x, weights, local, self.w13.fmt, self.w13.parts(), self.w2.parts(), self.activation)

    def _static(self, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Shapes fixed by T, no host sync (see the class's docstring)."""
        (tokens, k), count = local.shape, len(self.placement.experts)
        if tokens * k < count:  # gather each choice's weights (an expert held elsewhere: any local one, weight 0)
            chosen = local.clamp(max=count - 1)
            rows = [sum(self._mlp(x[t:t + 1], chosen[t, j:j + 1]) * weights[t, j] for j in range(k))
                    for t in range(tokens)]
            return torch.cat(rows)
        dense = torch.zeros(tokens, count + 1, dtype=x.dtype, device=x.device).scatter_add_(1, local, weights)
        return sum(self._mlp(x, e) * dense[:, e:e + 1] for e in range(count))

    def linear_names(self) -> list[str]:
        return [f"experts.{e}.{w}" for e in range(self.moe.num_experts) for w in ("w1", "w2", "w3")]

    def align_for(self, formats: dict[str, str], prefix: str) -> None:
        for e, expert in self.experts.items():
            w2 = formats.get(f"{prefix}experts.{e}.w2.weight")
            if w2 or any(f"{prefix}experts.{e}.{w}.weight" in formats for w in ("w1", "w3")):
                for layer in (expert.w1, expert.w2, expert.w3):
                    layer.align_(block_size(w2) if w2 else GROUP)

    def held_elsewhere(self) -> list[str]:
        """Every tensor name of the experts this rank does not hold (as its own experts' tensors are named)."""
        first = self.placement.experts.start
        own = [name for name in self.experts[str(first)].state_dict(keep_vars=True)]
        return [f"experts.{e}.{name}" for e in range(self.moe.num_experts) if e not in self.placement.experts
                for name in own]
