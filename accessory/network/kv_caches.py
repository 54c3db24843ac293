"""The KV caches a run decodes on: `KVCache`, one attention layer's keys and values, and `KVCaches`, every layer's for
one model on this rank. Whoever runs steps owns a KVCaches and hands it to each step (`Transformer.prefill`,
`decode`, `verify`), which hands each layer its own: the engine's runner one, the speculation cost timing and the
batch-size probe each another, so none of them disturbs the others'.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch._dynamo  # imported here, by one thread: two threads' first `torch._dynamo` at once fail (circular import)

from accessory.parallel import head_placement


class KVCache:
    """Preallocated keys and values for one attention layer: (rows, n_local_kv_heads, columns, head_dim).

    A row holds one sequence; its token at RoPE position p lives in column p, so rows at different positions
    share the cache (continuous batching) and no row ever needs padding. A sliding-window layer's cache is a ring
    (`ring`): it has at most `window` columns, and position p lives in column p % columns, so it holds the last
    `columns` positions of each row, all that layer ever attends to.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ring: bool = False):
        """Keys and values as they are (a compiled step's inputs); `allocate` makes new ones."""
        self.k, self.v, self.ring, self.columns = k, v, ring, k.shape[2]

    @classmethod
    def allocate(cls, rows: int, n_kv_heads: int, columns: int, head_dim: int, dtype, device,
                 ring: bool = False) -> "KVCache":
        shape = (rows, n_kv_heads, columns, head_dim)
        cache = cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                    ring)
        cache.mark_sizes()
        return cache

    def mark_sizes(self) -> None:
        """Tell dynamo which sizes never change: heads and head_dim (and a ring's width). Rows and (but on a ring)
        columns stay symbolic, so one compiled step serves every batch size and cache width."""
        for cache in (self.k, self.v):
            for dim in (1, 3) if not self.ring else (1, 2, 3):
                torch._dynamo.mark_static(cache, dim)

    def column(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.columns if self.ring else positions

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, H, D) of N tokens at cache rows `rows` (N,), positions `positions` (N,). On a ring, no two
        of the positions may share a column (the write's order among them is undefined)."""
        columns = self.column(positions)
        self.k[rows, :, columns] = k  # the advanced indices come first: (N, H, D)
        self.v[rows, :, columns] = v

    def move_rows(self, dst: list[int], src: list[int], end: int, source: Optional["KVCache"] = None,
                  start: int = 0) -> None:
        """Copy rows `src` to rows `dst` (positions start..end - 1; on a ring, from 0, the ones it still holds): a
        finished row's place is filled by a live one, a finished row is kept for reuse, a prompt takes a cached
        prefix. From `source`'s rows instead, a cache of the same layout: a self-draft takes the target's keys and
        values."""
        source = source or self
        if dst:
            dst_index, src_index, end = torch.tensor(dst), torch.tensor(src), min(end, self.columns)
            start = 0 if self.ring else start
            self.k[dst_index, :, start:end] = source.k[src_index, :, start:end]
            self.v[dst_index, :, start:end] = source.v[src_index, :, start:end]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVCaches:
    """Every attention layer's KV cache of one model on this rank: `rows` sequences of `columns` positions (a
    sliding-window layer's a ring of its window, if that is shorter), and with per-request PEFT adapters
    (`model.adapter_routing`), the adapter each row runs with (`adapters`), which moves with the row."""

    def __init__(self, layers: list[KVCache], columns: int, adapters: Optional[torch.Tensor] = None):
        """The caches as they are (a compiled step's inputs); `allocate` makes new ones."""
        self.layers, self.columns, self.adapters = layers, columns, adapters

    @classmethod
    def of_tensors(cls, pairs, columns: int, rings: Optional[tuple[bool, ...]] = None) -> "KVCaches":
        """Caches over given tensors, one (keys, values) pair per layer, written in place: how an exported step (an
        AOTInductor package, ONNX) takes them, as plain inputs. `rings`: which layers are rings (none by default)."""
        rings = rings or (False,) * len(pairs)
        return cls([KVCache(k, v, ring) for (k, v), ring in zip(pairs, rings)], columns)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values): the inverse of `of_tensors`."""
        return [(cache.k, cache.v) for cache in self.layers]

    @classmethod
    def allocate(cls, model, rows: int, columns: int) -> "KVCaches":
        if columns > model.args.max_seq_len:
            raise ValueError(f"{columns} positions requested; the model was set up for max_seq_len "
                             f"{model.args.max_seq_len}")
        layers = []
        for layer, window in zip(model.layers, model.windows):
            attn, width = layer.attention, layer_columns(window, columns)
            layers.append(KVCache.allocate(rows, attn.n_local_kv_heads, width, attn.head_dim, model.dtype,
                                           model.device, ring=width < columns))
        adapters = (torch.zeros(rows, dtype=torch.long, device=model.device)
                    if model.adapter_routing is not None else None)
        return cls(layers, columns, adapters)

    @property
    def rows(self) -> int:
        return self.layers[0].k.shape[0]

    @staticmethod
    def row_nbytes(model, columns: int) -> int:
        """Bytes one row of `columns` positions takes (its layers' keys and values) on the rank holding the most
        KV heads, tensor rank 0 of the pipeline stage whose layers' caches are widest: with uneven head splits ranks
        hold different numbers, stages hold different layers, and what is decided from this (rows kept for the
        prefix cache, caches kept between runs) must be decided alike on every rank."""
        args = model.args
        kv_heads = len(head_placement(args.n_heads, args.n_kv_heads, model.stage.tensor.world_size, 0).kv_heads)
        widths = max(sum(layer_columns(args.layer_window(i), columns) for i in layers) for layers in model.stage.split)
        return 2 * kv_heads * args.head_dim * widths * model.dtype.itemsize

    def nbytes(self, model) -> int:
        """Bytes of these caches on the rank holding the most KV heads: the same on every rank."""
        return self.rows * self.row_nbytes(model, self.columns)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.columns

    @property
    def rings(self) -> tuple[bool, ...]:
        return tuple(cache.ring for cache in self.layers)

    @property
    def has_rings(self) -> bool:
        """Whether some layers keep only a sliding window of positions (a ring)."""
        return any(self.rings)

    def reusable_prefix(self, length: int, held: int) -> int:
        """How much of a `length`-token prefix shared with a row holding `held` tokens can be copied from it
        (prefix caching): all of it, unless a sliding-window ring of the row no longer holds the positions just
        before `length` (the row went on past them), then none."""
        rings = [cache.columns for cache in self.layers if cache.ring]
        if not rings or held <= min(rings) or length == held:
            return length
        return 0

    def move_rows(self, dst: list[int], src: list[int], end: int) -> None:
        """Copy rows `src` (positions up to `end`) to rows `dst`, with their adapters."""
        for cache in self.layers:
            cache.move_rows(dst, src, end)
        if self.adapters is not None and dst:
            self.adapters[dst] = self.adapters[src].clone()  # cloned first: a row may be source and destination

    def copy_rows_from(self, other: "KVCaches", rows: list[int], start: int, end: int) -> None:
        """Rows `rows`' positions start..end - 1 from `other`, caches of the same layout (`same_layout`)."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.move_rows(rows, rows, end, theirs, start)

    def same_layout(self, other: "KVCaches") -> bool:
        """Whether every layer's cache has the same heads, width and dtype as `other`'s."""
        return len(self.layers) == len(other.layers) and all(
            mine.k.shape[1:] == theirs.k.shape[1:] and mine.k.dtype == theirs.k.dtype
            for mine, theirs in zip(self.layers, other.layers))


def layer_columns(window: Optional[int], columns: int) -> int:
    """A layer's cache width for `columns` positions: a sliding-window layer keeps at most its window."""
    return columns if window is None else min(window, columns)
