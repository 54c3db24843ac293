"""Sampling from logits that the model-parallel ranks hold in slices of the vocabulary (each rank's rows of the
output projection), with only what sampling needs crossing ranks. Each step, on every rank (`VocabSlice.reduce`):

1. each rank adjusts its slice of each row's logits as sampling would (logit bias, the penalties over the row's
   tokens, a grammar's mask sent by the source rank) and reduces it to a record (`Layout`): its k most likely
   tokens with their adjusted logits, and the log-sum-exp of its adjusted logits over the row's temperature; with
   log-probabilities asked for, also their raw logits, the raw log-sum-exp and its n most likely raw logits;
2. every rank gathers every rank's record and merges them alike (`Merged`): the k most likely of all (ties to the
   lowest id, as argmax), and the log-sum-exps of all; when no row samples (greedy rows need one round), only the
   source rank gathers them, and the others go on at once;
3. a sampled row whose kept tokens (min_p, top_k, top_p: sampling.kept_count) may reach past the k merged ones (a
   flat distribution, or sampling from every token: top_p 1, top_k 0, min_p 0) makes every rank, which sees the
   same, send more: k x 8, up to its whole slice.

A prompt's log-probabilities (OpenAI's `echo` with `logprobs`) cross ranks the same way (`slice_logprobs`): each
position's log-sum-exp, the next token's logit and the most likely logits of each rank's slice.

The source rank's scheduler samples from the merged `Candidates` (sampling.py). A greedy row's record is 3 floats
(k = 1); a sampled row's k is max(top_k, FIRST_CANDIDATES). At one rank the same code runs on the whole vocabulary,
so sampling does not depend on the rank count. Every rank knows each row's sampling (`RowRule`, sent once when the
row joins) and its tokens (the plans), so each keeps the row's penalties on its own slice.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from accessory.generation.sampling import UNKNOWN, Candidates, Penalties, SamplingParams, kept_counts

FIRST_CANDIDATES = 64  # a sampled row's candidates per rank in the first round (top_k's if larger)
WIDER = 8  # each further round sends this many times more
PAD_ID = float(2 ** 24 - 1)  # a padded candidate's id (float32 holds ids exactly below 2^24): after every real one


@dataclass(frozen=True)
class RowRule:
    """What every rank knows of a row's sampling: its parameters, and whether a grammar masks its tokens."""
    params: SamplingParams
    constrained: bool = False


@dataclass(frozen=True)
class Layout:
    """A record per row and position: k values, k ids; with `lse` (some row samples), the log-sum-exp; with `raw`
    (some row asks for log-probs), k raw logits, the raw log-sum-exp, `top` raw logits and their ids."""
    k: int
    top: int = 0
    raw: bool = False
    lse: bool = False

    @property
    def width(self) -> int:
        return 2 * self.k + self.lse + (self.k + 1 + 2 * self.top if self.raw else 0)


class VocabSlice:
    """This rank's slice of the vocabulary (`tokens`, padded to `size` alike on every rank) and what it knows of
    each live row's sampling: kept alike on every rank, with the ModelRunner's rows."""

    def __init__(self, ctx, tokens: range, size: int, vocab_size: int, device: torch.device):
        self.ctx, self.tokens, self.size, self.device = ctx, tokens, size, device
        self.words = -(-vocab_size // 32)  # a grammar's bitmask: 32 tokens a word
        ids = torch.arange(tokens.start, tokens.stop, device=device)
        self.word, self.bit = ids // 32, (ids % 32).to(torch.int32)
        self.rows: list[tuple[RowRule, Optional[Penalties]]] = []

    def admit(self, rules: Sequence[RowRule], prompts: Sequence[Sequence[int]]) -> None:
        for rule, prompt in zip(rules, prompts):
            penalties = Penalties(rule.params, list(prompt), self.tokens, self.device) if rule.params.penalized \
                else None
            self.rows.append((rule, penalties))

    def observe(self, results) -> None:
        """The tokens each row of the last step kept (a plan's `results`: plan.RowResult), for the penalties."""
        for (_, penalties), (tokens, _) in zip(self.rows, results):
            if penalties is not None:
                for token in tokens:
                    penalties.observe(token)

    def compact(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[row] for row in keep]

    @property
    def constrained(self) -> list[int]:
        return [row for row, (rule, _) in enumerate(self.rows) if rule.constrained]

    @property
    def sends_only(self) -> bool:
        """Whether `reduce` only sends this rank's records to the source rank (no row samples or has a grammar), so
        that a rank other than the source may reduce before it takes the next plan, and need not wait for it."""
        return not self.constrained and not self._first_layout().lse

    def reduce(self, local: torch.Tensor, proposed: Sequence[tuple[int, ...]],
               masks: Optional[torch.Tensor]) -> "Merged":
        """Collective. `local` (rows, L, size): this rank's logits of each row's L scored positions (the next token
        and `proposed[row]` after it); `masks`: on the source rank, the constrained rows' grammar bitmasks (rows,
        L, words) int32, in row order (ignored elsewhere). Every rank's merged candidates, the same on each; where
        no row samples (greedy, a single round), on the source rank alone (None elsewhere)."""
        z = local[..., :len(self.tokens)].float()
        adjusted = self._adjusted(z, proposed, self._shared(masks, local.shape[1]))
        layout = self._first_layout()
        if not layout.lse:  # no row samples: one round whatever the values, which only the sampling rank needs
            everyone = self.ctx.gather_to_source(self._records(z, adjusted, layout)[None], dim=0)
            return None if everyone is None else Merged(everyone, layout, layout.k >= self.size,
                                                        [rule.params for rule, _ in self.rows])
        while True:
            records = self._records(z, adjusted, layout)
            merged = Merged(self.ctx.all_gather(records[None], dim=0), layout, layout.k >= self.size,
                            [rule.params for rule, _ in self.rows])
            if merged.complete or not merged.short(proposed):
                return merged
            layout = replace(layout, k=min(layout.k * WIDER, self.size))

    def _first_layout(self) -> Layout:
        params = [rule.params for rule, _ in self.rows]
        sampled = [max(p.top_k, FIRST_CANDIDATES) for p in params if not p.greedy]
        tops = [p.logprobs for p in params if p.logprobs is not None]
        return Layout(min(max(sampled, default=1), self.size), max(tops, default=0), bool(tops), bool(sampled))

    def _shared(self, masks: Optional[torch.Tensor], slots: int) -> Optional[torch.Tensor]:
        """The source rank's grammar bitmasks, on every rank (nothing is sent when no row is constrained)."""
        count = len(self.constrained)
        if not count:
            return None
        if not self.ctx.is_source:
            masks = torch.empty(count, slots, self.words, dtype=torch.int32, device=self.device)
        return self.ctx.broadcast(masks.contiguous())

    def _adjusted(self, z: torch.Tensor, proposed: Sequence[tuple[int, ...]],
                  masks: Optional[torch.Tensor]) -> torch.Tensor:
        """z (rows, L, slice) with each row's grammar mask, logit bias and penalties applied; slot s of a row as if
        the proposals before it had been accepted."""
        if masks is None and all(penalties is None for _, penalties in self.rows):
            return z
        adjusted = z.clone()
        if masks is not None:
            allowed = ((masks[..., self.word] >> self.bit) & 1).bool()  # (constrained rows, L, slice)
            adjusted[self.constrained] = adjusted[self.constrained].masked_fill(~allowed, float("-inf"))
        for row, (_, penalties) in enumerate(self.rows):
            if penalties is not None:
                ahead = proposed[row] if row < len(proposed) else ()
                for slot in range(z.shape[1]):
                    adjusted[row, slot] = penalties.apply(adjusted[row, slot], tuple(ahead[:slot]))
        return adjusted

    def _records(self, z: torch.Tensor, adjusted: torch.Tensor, layout: Layout) -> torch.Tensor:
        """(rows, L, layout.width): this rank's record of each row and position."""
        if not len(self.tokens):  # a pipeline stage before the head: nothing to offer, made at no cost
            return self._nothing(z.shape[:2], layout)
        return self._slice_records(z, adjusted, layout)

    def _slice_records(self, z: torch.Tensor, adjusted: torch.Tensor, layout: Layout) -> torch.Tensor:
        k, short = layout.k, max(0, max(layout.k, layout.top) - z.shape[-1])
        if short:  # a slice smaller than k or top (its tail past the vocabulary): -inf, PAD_ID
            pad = lambda t: torch.nn.functional.pad(t, (0, short), value=float("-inf"))  # noqa: E731
            z, adjusted = pad(z), pad(adjusted)
        values, index = row_max(adjusted) if k == 1 else adjusted.topk(k, dim=-1)
        ids = (index + self.tokens.start).float()
        if short:
            ids = ids.masked_fill(index >= len(self.tokens), PAD_ID)
        parts = [values, ids] + ([self._lse(adjusted)] if layout.lse else [])
        if layout.raw:
            parts += [z.gather(-1, index), torch.logsumexp(z, dim=-1, keepdim=True)]
            if layout.top:
                top, top_index = z.topk(layout.top, dim=-1)
                top_ids = (top_index + self.tokens.start).float()
                parts += [top, top_ids.masked_fill(top_index >= len(self.tokens), PAD_ID) if short else top_ids]
        return torch.cat(parts, dim=-1)

    def _nothing(self, lead: torch.Size, layout: Layout) -> torch.Tensor:
        """The records of an empty slice, as `_slice_records` makes them: every value -inf, every id PAD_ID, a greedy
        row's log-sum-exp 0."""
        records = torch.full((*lead, layout.width), float("-inf"), device=self.device)
        if layout.lse:
            greedy = torch.tensor([rule.params.greedy for rule, _ in self.rows], device=self.device)
            records[..., 2 * layout.k].masked_fill_(greedy[:, None], 0.0)
        ids = [(layout.k, layout.k)]
        if layout.raw and layout.top:
            start = 2 * layout.k + layout.lse + layout.k + 1 + layout.top
            ids.append((start, layout.top))
        for start, n in ids:
            records[..., start:start + n] = PAD_ID
        return records

    def _lse(self, adjusted: torch.Tensor) -> torch.Tensor:
        """(rows, L, 1): each sampled row's log-sum-exp of adjusted / temperature (0 for greedy rows)."""
        scale = torch.tensor([0.0 if rule.params.greedy else 1.0 / rule.params.temperature for rule, _ in self.rows],
                             device=adjusted.device)
        sampled = scale.nonzero()[:, 0]
        if len(sampled) == len(scale):
            return torch.logsumexp(adjusted * scale[:, None, None], dim=-1, keepdim=True)
        lse = torch.zeros(*adjusted.shape[:2], 1, device=adjusted.device)
        lse[sampled] = torch.logsumexp(adjusted[sampled].mul_(scale[sampled, None, None]), dim=-1, keepdim=True)
        return lse


class Merged:
    """Every rank's records of each row and position, merged: `at(row, slot)` is its Candidates. `complete`: the
    records held whole slices (every token); `params`: each row's sampling."""

    def __init__(self, everyone: torch.Tensor, layout: Layout, complete: bool, params: list[SamplingParams]):
        k, self.layout, self.complete = layout.k, layout, complete
        columns = lambda start, n: everyone[..., start:start + n].movedim(0, -2).flatten(-2)  # noqa: E731
        values, ids = columns(0, k), columns(k, k)  # (rows, L, ranks * k)
        if k == 1:  # greedy rows only: the first rank's largest among equals has the lowest id
            best = values.max(dim=-1, keepdim=True)
            self.values, order = best.values, best.indices
        else:
            kept = values.shape[-1] if complete else k  # the k largest of each rank's k largest: of all
            order = largest_first(values, ids)[..., :kept]
            self.values = values.gather(-1, order)
        self.ids = ids.gather(-1, order).long()
        lse = torch.logsumexp(everyone[..., 2 * k], dim=0) if layout.lse else None  # (rows, L)
        self.kept = kept_counts(self.values, lse, complete, params) if layout.lse else None
        raw = 2 * k + layout.lse  # where the raw part begins
        if layout.raw:
            self.raw = columns(raw, k).gather(-1, order)
            self.raw_lse = torch.logsumexp(everyone[..., raw + k], dim=0)
            top_values, top_ids = columns(raw + k + 1, layout.top), columns(raw + k + 1 + layout.top, layout.top)
            top_order = top_values.argsort(dim=-1, descending=True, stable=True)[..., :layout.top]
            self.top_values, self.top_ids = top_values.gather(-1, top_order), top_ids.gather(-1, top_order).long()

    def at(self, row: int, slot: int) -> Candidates:
        raw = self.layout.raw
        return Candidates(self.ids[row, slot], self.values[row, slot],
                          int(self.kept[row, slot]) if self.kept is not None else 1,
                          self.raw[row, slot] if raw else None, float(self.raw_lse[row, slot]) if raw else None,
                          self.top_ids[row, slot] if raw else None, self.top_values[row, slot] if raw else None)

    def short(self, proposed: Sequence[tuple[int, ...]]) -> bool:
        """Whether some row's kept tokens may reach past the candidates, at a position it may sample."""
        if self.kept is None:
            return False
        rows, slots = self.kept.shape
        last = torch.tensor([len(proposed[row]) if row < len(proposed) else 0 for row in range(rows)])
        return bool(((self.kept == UNKNOWN) & (torch.arange(slots) <= last[:, None])).any())


def largest_first(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The order of candidates (..., n) from the largest value down, ties to the lowest id (as argmax): by id, then
    stably by value."""
    by_id = ids.argsort(dim=-1, stable=True)
    return by_id.gather(-1, values.gather(-1, by_id).argsort(dim=-1, descending=True, stable=True))


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.max(dim=-1, keepdim=True)`: the largest value of each row and its first index. torch's max with indices
    does not vectorize on the CPU (0.17 ms for 4 rows of 49152 logits, 14x its `amax`), so a long row is cut into
    chunks: the first chunk holding the largest, then the first index within it."""
    n = x.shape[-1]
    width = min(256, n & -n)  # chunks of a power of two that divides n
    if n < 16384 or width < 32:
        return x.max(dim=-1, keepdim=True)
    chunks = x.unflatten(-1, (n // width, width))
    best = chunks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # NaN counts as largest, as in max
    chunk = chunks.gather(-2, best[..., None].expand(*best.shape, width))[..., 0, :]
    values, within = chunk.max(dim=-1, keepdim=True)
    return values, best * width + within


def slice_argmax(ctx, local: torch.Tensor, tokens: range) -> list[int]:
    """Collective: the argmax over the whole vocabulary of each row's logits, of which this rank holds `local`
    (rows, its padded slice) for `tokens`; the same on every rank (ties to the lowest id)."""
    mine = local[:, :len(tokens)].float() if len(tokens) else torch.full((len(local), 1), float("-inf"))
    values, index = (part[..., 0] for part in row_max(mine))
    best = ctx.all_gather(torch.stack([values, (index + tokens.start).float()], dim=-1)[None], dim=0)
    rank = best[..., 0].max(dim=0).indices  # the first rank holding a row's largest: its lowest id
    return best[..., 1].gather(0, rank[None])[0].long().tolist()


@dataclass(frozen=True)
class PositionLogprobs:
    """Log-probabilities at N positions of a sequence: each position's next token's, and the most likely tokens'
    (most likely first; ids as the vocabulary's)."""
    chosen: torch.Tensor  # (N,)
    top_ids: torch.Tensor  # (N, top) int64
    top_logprobs: torch.Tensor  # (N, top)


def slice_logprobs(ctx, local: torch.Tensor, tokens: range, targets: torch.Tensor, top: int) -> PositionLogprobs:
    """Collective: at each of N positions, the log-probability of targets[i] and the `top` most likely tokens', under
    logits of which this rank holds `local` (N, its padded slice) for `tokens`; the same on every rank. What crosses
    ranks is 2 + 2 * top floats a position: each rank's log-sum-exp, its logit of the target (-inf where another
    rank holds it), and its `top` largest logits and their ids."""
    n, device = len(local), local.device
    mine = local[:, :len(tokens)].float()
    lse = torch.logsumexp(mine, dim=-1) if len(tokens) else torch.full((n,), float("-inf"), device=device)
    inside = (targets >= tokens.start) & (targets < tokens.stop)
    chosen = torch.full((n,), float("-inf"), device=device)
    chosen[inside] = mine[inside.nonzero()[:, 0], targets[inside] - tokens.start]
    k = min(top, len(tokens))
    values, index = mine.topk(k, dim=-1)
    values = torch.cat([values, torch.full((n, top - k), float("-inf"), device=device)], dim=-1)
    ids = torch.cat([(index + tokens.start).float(), torch.full((n, top - k), PAD_ID, device=device)], dim=-1)
    everyone = ctx.all_gather(torch.cat([lse[:, None], chosen[:, None], values, ids], dim=-1)[None], dim=0)
    total = torch.logsumexp(everyone[..., 0], dim=0)  # (N,)
    candidates = everyone[..., 2:2 + top].movedim(0, -2).flatten(-2)  # (N, ranks * top)
    candidate_ids = everyone[..., 2 + top:].movedim(0, -2).flatten(-2)
    order = largest_first(candidates, candidate_ids)[:, :top]
    return PositionLogprobs(everyone[..., 1].max(dim=0).values - total, candidate_ids.gather(-1, order).long(),
                            candidates.gather(-1, order) - total[:, None])
