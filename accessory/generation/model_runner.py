"""What runs on each rank: one run's KV cache rows and the static step that feeds them (engine.py drives it, every
rank alike, from the plans that wire.py shares).

A row's token at position p lives in KV-cache column p: rows at different positions share one cache, nothing is
padded, and a row that leaves frees its cache row at once (a live row from the end takes its place). One step,
`ModelRunner.step(plan)`, top to bottom:
1. `_score`: the prompts whose every position's logits were asked for get a forward pass of their own (their
   log-probabilities are reduced with the step's logits, in `reduce`).
2. `compact`: the rows that finished are copied into the retained rows (`_retain`, for the prefix cache), then the
   kept rows move into the holes, so the live rows are 0..n-1 again.
3. `_decode`: one token for each kept row at that row's next position, through `Engine.decode_step`
   (`Transformer.decode`: static shapes, no host sync; with `compile`, a compiled graph: steps.py; under a pipeline,
   each stage's, with the hidden states handed on between them: `Transformer.through`), attending over
   a power-of-two number of columns (`_bucket`). With speculative decoding, rows with proposals (speculative.py)
   are scored with them in one `Engine.verify_step` instead (`_verify`), and the next step first drops the
   proposals the source rank rejected (`_settle`).
4. `prefill`: the joining prompts, packed into one sequence (`_prefill_packed`). A joining prompt that starts with
   tokens some cache row already holds (a live row, or a finished one kept for reuse) copies their keys and values
   instead of recomputing them (`_copy_prefixes`, prefix.py); every rank decides that alike from the plans.
5. Each rank's logits (its slice of the vocabulary) stay on it: `reduce`, collective and apart from `step` (a
   pipeline's later stages run a plan after the first: engine.py), has every rank reduce its slice to what sampling
   needs (`vocab`, vocab_slices.py), and the source rank's scheduler samples from the merged candidates.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from accessory.generation.plan import Joining, Plan, RowResult
from accessory.generation.prefix import RetainedRows, plan_reuse, waves
from accessory.generation.speculative import RowBudget, accepted_count
from accessory.generation.sampling import MAX_LOGPROBS
from accessory.generation.vocab_slices import Merged, PositionLogprobs, VocabSlice, slice_logprobs
from accessory.network.components import Segment, decode_mask
from accessory.network.kv_caches import KVCaches
from accessory.network.vision import image_key

MIN_COLUMNS = 256  # the smallest KV-cache and attention width: widths are powers of two from here
PREFILL_TOKENS = 4096  # prompt tokens prefilled in one forward pass at most (more run in several)
# ... under a pipeline: a long prompt passes through the stages in pieces this long, so that while a later stage
# computes one piece, the first computes the next
STAGE_PREFILL_TOKENS = 256


class Stepped(NamedTuple):
    """A step's output on this rank, before the ranks reduce it together (`ModelRunner.reduce`): its logits (rows,
    L, local vocab; None: no rows ran), and each scored prompt's logits with the tokens they score."""
    logits: Optional[torch.Tensor]
    scores: list[tuple[torch.Tensor, torch.Tensor]]


class ModelRunner:
    """One run's rows on this rank, for one `Engine` (its model, context, settings, decode step and stats): the KV
    caches (`caches`: the engine's, for `columns` rounded up to a power of two) and what each row holds. Rows 0..n-1 are the live
    ones; past the batch's rows, `retained` keeps finished sequences for prompts to reuse."""

    def __init__(self, engine, rows: int, columns: int, keep_finished: bool = True, lanes: int = 1):
        """`lanes`: how many runners of the run share the prefix cache's bytes (a pipeline's micro-batches)."""
        self.engine, self.model, self.rows = engine, engine.model, rows
        self.columns = _bucket(columns, engine.max_seq_len)
        self.cached: list[list[int]] = []  # the tokens each live row holds in columns 0..len-1 (fed, not sampled)
        speculation = engine.speculation
        self.proposer = speculation and speculation.proposer(rows, columns, keep_finished)  # None: no speculation
        self.budgets: list[RowBudget] = []  # how many tokens each live row proposes
        self.proposed: list[tuple[int, ...]] = []  # each row's proposals scored in the last step (source: its rows)
        self.vocab = VocabSlice(engine.ctx, *engine.vocab_slice(), engine.vocab_size, self.model.device)
        live = max(rows, 2)  # at least 2: torch.compile gives a size of 1 a graph of its own; a cache row is cheap
        retained = self._retained_rows(rows, self.columns, lanes) if keep_finished else 0
        self.retained = RetainedRows(live, retained)
        with torch.inference_mode():
            self.caches = engine.caches(live + len(self.retained.tokens), self.columns)

    def _retained_rows(self, rows: int, columns: int, lanes: int) -> int:
        """Finished sequences kept: as many rows as fit in this runner's share of prefix_cache_bytes, at most the
        batch's rows."""
        settings = self.engine.settings
        if not settings.prefix_cache:
            return 0
        return min(rows, settings.prefix_cache_bytes // lanes // KVCaches.row_nbytes(self.model, columns))

    @torch.inference_mode()
    def step(self, plan: Plan) -> "Stepped":
        """Run `plan` on this rank, up to what the ranks must reduce together (`reduce`)."""
        scores = [self._score(tokens) for tokens in plan.score]
        self._settle(plan.results)
        self.vocab.observe(plan.results)
        self.compact(plan.keep)
        self.vocab.compact(plan.keep)
        if plan.rows > self.rows:
            raise RuntimeError(f"plan has {plan.rows} rows; the batch holds {self.rows}")
        self.proposed = []
        parts = [self._decode(plan.tokens)] if plan.keep else []  # (rows, L, local vocab)
        if plan.joining:
            slots = parts[0].shape[1] if parts else 1
            parts.append(self._admit(plan.joining)[:, None].expand(-1, slots, -1))  # a prompt's in its first slot
        logits = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        return Stepped(logits, scores)

    def _admit(self, joining: Joining) -> torch.Tensor:
        """Prefill the joining prompts into the rows after the kept ones; their last tokens' logits (prompts, local
        vocabulary)."""
        images = joining.each_image()
        logits = self.prefill(joining.prompts, images, joining.adapters)
        self.vocab.admit(joining.rules, joining.prompts)
        if self.proposer is not None:
            self.proposer.admit(joining.prompts, images, self)
            self.budgets += [RowBudget(self.engine.speculation.costs()) for _ in joining.prompts]
        self.proposed += [()] * len(joining)
        return logits

    @torch.inference_mode()
    def reduce(self, stepped: Optional["Stepped"], scheduler) -> tuple[Optional[Merged], list[PositionLogprobs]]:
        """Collective. A step's output (`stepped`; None: no step) on every rank reduced to what the source rank
        needs: the logits of the rows that ran, to what sampling needs, with the source rank's `scheduler`'s grammar
        masks (None elsewhere), merged (vocab_slices.py), or None if no rows ran; and on the source rank (else
        []), the log-probabilities of each prompt the step scored."""
        if stepped is None:
            return None, []
        scored = [self._logprobs(local, targets) for local, targets in stepped.scores]
        scored = scored if self.engine.ctx.is_source else []
        if stepped.logits is None:
            return None, scored
        local = stepped.logits
        masks = scheduler.masks(self.proposed, local.shape[1]) if scheduler is not None else None
        return self.vocab.reduce(local, self.proposed, masks), scored

    # ---- 1. scoring -------------------------------------------------------------------------------------------------

    def _score(self, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's logits (its vocabulary slice) at each position of `tokens` but the last, and the tokens after
        them, for `reduce` to turn into log-probabilities (a forward pass of its own, nothing cached: reused
        prefixes have no logits)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        return self.model.through(self.model.forward, ids, gather=False)[0, :-1], ids[0, 1:]

    def _logprobs(self, local: torch.Tensor, targets: torch.Tensor) -> PositionLogprobs:
        """Collective: a scored prompt's log-probabilities from every rank's `_score`."""
        return slice_logprobs(self.engine.ctx, local, self.vocab.tokens, targets,
                              min(MAX_LOGPROBS, self.engine.vocab_size))

    # ---- 2. compaction ----------------------------------------------------------------------------------------------

    def _settle(self, results: tuple[RowResult, ...]) -> None:
        """Drop from each row the proposals the last step fed but the source rank did not keep (`results`: each
        row's kept tokens, as the plan says), so its next token goes where the first rejected one went."""
        stats = self.engine.stats
        for row, ((kept, _), proposed) in enumerate(zip(results, self.proposed)):
            if proposed:
                accepted = accepted_count(proposed, kept)
                del self.cached[row][len(self.cached[row]) - len(proposed) + accepted:]
                self.budgets[row].observe(len(proposed), accepted)
                stats.proposed_tokens += len(proposed)
                stats.accepted_tokens += accepted

    def compact(self, keep: tuple[int, ...]) -> None:
        """Finished rows leave (kept for reuse if they fit), the rows in `keep` become rows 0..len(keep)-1."""
        kept = set(keep)
        self._retain([row for row in range(len(self.cached)) if row not in kept])
        moves = [(dst, src) for dst, src in enumerate(keep) if dst != src]
        if moves:
            end = max(len(self.cached[src]) for _, src in moves)
            self.caches.move_rows([d for d, _ in moves], [s for _, s in moves], end)
        self.cached = [self.cached[src] for src in keep]
        if self.proposer is not None:
            self.budgets = [self.budgets[src] for src in keep]
            self.proposer.compact(keep)

    def _retain(self, finished: list[int]) -> None:
        """Copy finished rows into the retained rows, before compaction overwrites them."""
        copies = {}  # retained row -> finished row (a later one wins a slot two want)
        for row in finished:
            slot = self.retained.keep(self.cached[row])
            if slot is not None:
                copies[slot] = row
        if copies:
            end = max(len(self.cached[src]) for src in copies.values())
            self.caches.move_rows(list(copies), list(copies.values()), end)

    # ---- 3. the decode step -----------------------------------------------------------------------------------------

    def _decode(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """This rank's logits (len(tokens), L, local vocab): with no proposals (L = 1) of one token for each of the
        first len(tokens) rows; else of each row's token and its proposals after it, from `_verify`."""
        proposals = self._propose(tokens)
        if any(proposals):
            return self._verify(tokens, proposals)
        self.proposed = [()] * len(tokens)
        n, device = len(tokens), self.model.device
        ends = [len(row) for row in self.cached]  # each row's next position
        width = _bucket(max(ends) + 1, self.columns)
        padded = self._padded_rows(n)  # rows past n decode junk at position 0; a prompt's copy or prefill follows
        token_ids = torch.zeros(padded, dtype=torch.long)
        token_ids[:n] = torch.tensor(tokens)
        positions = torch.zeros(padded, dtype=torch.long)
        positions[:n] = torch.tensor(ends)
        token_ids, positions = token_ids.to(device), positions.to(device)
        logits = self.model.through(self.engine.decode_step, token_ids, positions, decode_mask(positions, width),
                                    self.caches)
        for row, token in zip(self.cached, tokens):
            row.append(token)
        return logits[:n, None]

    def _propose(self, tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Each row's proposals for the tokens after `tokens[row]`, as many as its budget and the cache allow."""
        if self.proposer is None:
            return []
        limits = [min(budget.next(), self.columns - 1 - len(row)) for budget, row in zip(self.budgets, self.cached)]
        if not any(limits):
            return []
        return self.proposer.propose(self, tokens, limits)

    def _verify(self, tokens: tuple[int, ...], proposals: list[tuple[int, ...]]) -> torch.Tensor:
        """This rank's logits (rows, L, local vocab) of each row's next token and its proposals after it."""
        self.proposed = list(proposals)
        return self.feed([(token, *proposed) for token, proposed in zip(tokens, proposals)])

    def feed(self, sequences: list[tuple[int, ...]]) -> torch.Tensor:
        """Write sequences[row] into each of the first len(sequences) rows after what it holds, in L = the longest
        one's slots per row; this rank's logits (rows, L, local vocab) at every slot. A shorter row fills its spare
        slots with its last token at the positions after it (columns no step has reached: each is rewritten before
        any token attends to it), or at the cache's last column; so does an empty one, whose row is unchanged."""
        n, device = len(sequences), self.model.device
        slots = max(max(len(seq) for seq in sequences), 1)
        padded = self._padded_rows(n)
        token_ids = torch.zeros(padded, slots, dtype=torch.long)
        positions = torch.zeros(padded, slots, dtype=torch.long)
        for row, (seq, cached) in enumerate(zip(sequences, self.cached)):
            last = seq[-1] if seq else cached[-1]
            token_ids[row] = torch.tensor(seq + (last,) * (slots - len(seq)))
            start = len(cached) if seq else self.columns - 1
            positions[row] = (torch.arange(slots) + start).clamp(max=self.columns - 1)
        width = _bucket(int(positions.max()) + 1, self.columns)
        token_ids, positions = token_ids.to(device), positions.to(device)
        if slots == 1:
            logits = self.model.through(self.engine.decode_step, token_ids[:, 0], positions[:, 0],
                                        decode_mask(positions[:, 0], width), self.caches)
            logits = logits[:, None]
        else:
            logits = self.model.through(self.engine.verify_step, token_ids, positions, decode_mask(positions, width),
                                        self.caches)
        for row, seq in zip(self.cached, sequences):
            row.extend(seq)
        return logits[:n]

    def _padded_rows(self, n: int) -> int:
        """On CUDA graphs, a power-of-two number of rows (few graphs to capture); otherwise exactly n."""
        if not (self.engine.settings.compile and self.model.device.type == "cuda"):
            return n
        return min(1 << (n - 1).bit_length(), self.rows)

    # ---- 4. packed prefill, reusing cached prefixes -----------------------------------------------------------------

    def prefill(self, admit: tuple[tuple[int, ...], ...], images: tuple, adapters: tuple = ()) -> torch.Tensor:
        """Write each prompt (with its image's pixels, or None; run with its PEFT adapter, default 0: none) into its
        new row (after the current ones), reusing cached prefixes; this rank's logits (prompts, local vocab) of
        each prompt's last token."""
        adapters = adapters or (0,) * len(admit)
        prompts = [list(p) for p in admit]
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) >= self.columns:
            raise ValueError(f"prompt lengths {lengths} must be in 1..{self.columns - 1} (the cache's columns)")
        first = len(self.cached)
        held = [self._contents(prompt, image, adapter) for prompt, image, adapter in zip(prompts, images, adapters)]
        plans = (plan_reuse(held, self.cached, self.retained, self.caches.reusable_prefix)
                 if self.engine.settings.prefix_cache else [None] * len(prompts))
        self.cached += held
        pasts = [plan.length if plan else 0 for plan in plans]
        order, logits = [], []
        budget = PREFILL_TOKENS if self.model.stage.count == 1 else STAGE_PREFILL_TOKENS
        for wave in waves(plans):  # a prompt copying from one admitted with it waits for that one's prefill
            self._copy_prefixes([(first + i, plans[i]) for i in wave if plans[i] is not None])
            spans = [(pasts[i], lengths[i]) for i in wave]
            uncut = {j for j, i in enumerate(wave) if images[i] is not None}  # an image's positions go together
            for pieces in _passes(spans, budget, uncut):
                out = self._prefill_packed([(prompts[wave[j]][:end], first + wave[j], start, images[wave[j]],
                                             adapters[wave[j]]) for j, start, end in pieces])
                ends = [k for k, (j, _, end) in enumerate(pieces) if end == lengths[wave[j]]]
                logits.append(out[ends])
                order += [wave[pieces[k][0]] for k in ends]
        self.engine.stats.prefilled_tokens += sum(lengths) - sum(pasts)
        self.engine.stats.reused_tokens += sum(pasts)
        logits = torch.cat(logits)
        return logits if order == sorted(order) else logits[torch.tensor(order, device=logits.device).argsort()]

    def adopt(self, admit: tuple[tuple[int, ...], ...], images: tuple, source: "ModelRunner") -> None:
        """Write each prompt into its new row (after the current ones) by copying its keys and values from the same
        row of `source`, which has just prefilled it, instead of computing them: a draft that is the target's own
        weights quantized takes the target's (its cache has the same layout, and its own values would be close),
        and so prefills nothing."""
        first = len(self.cached)
        held = [self._contents(list(prompt), image) for prompt, image in zip(admit, images)]
        self.copy_columns(source, list(range(first, first + len(held))), 0, max(len(row) for row in held))
        self.cached += held

    def copy_columns(self, source: "ModelRunner", rows: list[int], start: int, end: int) -> None:
        """Copy the keys and values of columns start..end - 1 of `rows` from the same rows of `source`, a runner
        this one `mirrors` (what each row holds is the caller's to record)."""
        self.caches.copy_rows_from(source.caches, rows, start, end)

    def mirrors(self, source: "ModelRunner") -> bool:
        """Whether this runner's KV cache has `source`'s layout, so that `adopt` can copy rows: as many layers, each
        with the same heads, columns, head size and dtype (the retained rows past the live ones may differ)."""
        return self.caches.same_layout(source.caches)

    def _contents(self, prompt: list[int], image, adapter: int = 0) -> list:
        """What a row holds, as the prefix cache compares it: the prompt's tokens, an image's positions keyed by
        the image itself (negative: no token has such an id), so that only the same image is ever reused. A row
        run with a PEFT adapter holds other keys and values for the same tokens: its first position is keyed
        (adapter, token), so only rows of the same adapter share a prefix."""
        if image is not None:
            key = -1 - image_key(image)
            prompt = [key if token == self.model.image_token else token for token in prompt]
        return [(adapter, prompt[0]), *prompt[1:]] if adapter else prompt

    def _copy_prefixes(self, copies: list) -> None:
        """Copy each (row, Reuse)'s prefix from its source row."""
        if copies:
            self.caches.move_rows([row for row, _ in copies], [plan.source for _, plan in copies],
                                  max(plan.length for _, plan in copies))
            for _, plan in copies:
                self.retained.used(plan.source)

    def _prefill_packed(self, parts: list[tuple[list[int], int, int, Optional[torch.Tensor], int]]) -> torch.Tensor:
        """Prefill (prompt, row, past, image, adapter) parts packed into one sequence: each prompt's tokens from
        `past` on."""
        tokens = torch.tensor([t for prompt, _, past, *_ in parts for t in prompt[past:]], dtype=torch.long,
                              device=self.model.device)
        segments, start = [], 0
        for prompt, row, past, _, adapter in parts:
            segments.append(Segment(start, len(prompt) - past, row, past, adapter))
            start += len(prompt) - past
        return self.model.through(self.model.prefill, tokens, segments, self.caches,
                                  [image for _, _, _, image, _ in parts], lead=(len(segments),))


def _bucket(columns: int, limit: int) -> int:
    """A power of two >= columns (at least MIN_COLUMNS), at most `limit`."""
    return min(max(MIN_COLUMNS, 1 << (columns - 1).bit_length()), limit)


def _passes(spans: list[tuple[int, int]], budget: int, uncut: set[int]) -> list[list[tuple[int, int, int]]]:
    """The prompts' spans to prefill (columns start..end - 1 of prompt i), packed in order into forward passes of
    at most `budget` tokens: each pass a list of pieces (i, start, end). A prompt that does not fit in what is left
    of a pass is cut, its next piece first in the next pass (attending to the columns its earlier pieces wrote),
    except a prompt in `uncut`, which starts a pass of its own if it does not fit (and may exceed the budget)."""
    passes, current, room = [], [], budget
    for i, (start, end) in enumerate(spans):
        while start < end:
            if i in uncut and current and end - start > room:
                passes.append(current)
                current, room = [], budget
            take = end - start if i in uncut else min(end - start, room)
            current.append((i, start, start + take))
            start, room = start + take, room - take
            if room <= 0:
                passes.append(current)
                current, room = [], budget
    return passes + ([current] if current else [])
