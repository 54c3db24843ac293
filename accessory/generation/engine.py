"""The decode loop for one wave of prompts: identical tokens on every model-parallel rank, per-row stopping.

Prompts of different lengths are left-padded so that every row's next token lands in the same cache column; each
row keeps its own RoPE positions and never sees padding. A row that stops is dropped from the batch (its cache
rows are compacted away), so it costs no more compute. Rank agreement is structural: the source rank's sampled
tokens are broadcast every step, so no caller has to seed every rank's global RNG alike.
"""
from __future__ import annotations

from typing import Collection, Iterator, Optional

import torch

from accessory.generation.sampling import SamplingParams, sample


def decode_steps(model, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 stop_ids: Collection[int] = (), stopped: Optional[list[bool]] = None,
                 keep_cache_bytes: int = 0) -> Iterator[list[Optional[int]]]:
    """Yield, per step, each row's new token, or None for a row that has stopped or just hit a stop token.

    A row stops after `params.max_gen_len` tokens, on a token in `stop_ids` (not yielded), or when the caller sets
    `stopped[row]` between steps (stop strings are the caller's: they need text). Every prompt plus max_gen_len must
    fit in max_seq_len (the caller truncates). The KV cache is kept afterwards only if it is at most
    `keep_cache_bytes` (a pool of one, reused by the next call that fits).
    """
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty after tokenization")
    if width + params.max_gen_len > model.args.max_seq_len:
        raise ValueError(f"prompt ({width} tokens) + max_gen_len ({params.max_gen_len}) exceeds max_seq_len "
                         f"({model.args.max_seq_len})")
    device = model.rotations.device
    stopped = stopped if stopped is not None else [False] * batch
    stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

    pad = torch.tensor([width - n for n in lengths], device=device)  # (B,) left padding per row
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
    padded = bool(pad.any())
    columns = torch.arange(width + params.max_gen_len, device=device)
    key_valid = columns[None, :] >= pad[:, None] if padded else None  # (B, total): False on padding
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(batch, model.args.vocab_size, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            seen[row, torch.tensor(prompt, device=device)] = True

    model.setup_caches(batch, width + params.max_gen_len)
    try:
        positions = (columns[None, :width] - pad[:, None]).clamp(min=0) if padded else None
        logits = model(tokens, 0, positions, key_valid, last_only=True)
        active = list(range(batch))  # the original row of each batch slot
        for step in range(params.max_gen_len):
            chosen = model.ctx.broadcast(sample(logits, params, generator, seen).to(model.ctx.device)).to(device)
            is_stop = torch.isin(chosen, stop_ids).tolist()
            out: list[Optional[int]] = [None] * batch
            for slot, (row, token) in enumerate(zip(active, chosen.tolist())):
                out[row] = None if is_stop[slot] else token
                stopped[row] = stopped[row] or is_stop[slot] or step + 1 == params.max_gen_len
            yield out
            keep = [slot for slot, row in enumerate(active) if not stopped[row]]
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows: they cost nothing from here on
                index = torch.tensor(keep, device=device)
                model.keep_cache_rows(index)
                active = [active[slot] for slot in keep]
                chosen, pad = chosen[index], pad[index]
                key_valid = key_valid[index] if key_valid is not None else None
                seen = seen[index] if seen is not None else None
            if seen is not None:
                seen[torch.arange(len(active), device=device), chosen] = True
            column = width + step
            logits = model(chosen[:, None], column, (column - pad)[:, None], key_valid, last_only=True)
    finally:
        if model.cache_nbytes > keep_cache_bytes:
            model.free_caches()
