"""The decode loop: prompts in, one step of new tokens per row out, identical on every model-parallel rank.

Rank agreement is structural: the source rank's sampled tokens are broadcast every step, so no caller has to seed
every rank's global RNG alike. The KV cache is allocated for the call and freed after it.
"""
from __future__ import annotations

from typing import Collection, Iterator, Optional

import torch

from accessory.generation.sampling import sample


def decode_steps(model, prompts: list[list[int]], max_gen_len: int, temperature: float = 0.0, top_p: float = 0.95,
                 seed: int = 0, stop_ids: Collection[int] = (),
                 stopped: Optional[list[bool]] = None) -> Iterator[list[Optional[int]]]:
    """Yield, per step, each row's new token (None for a row that is still reading its prompt or has stopped).

    A row stops after `max_gen_len` tokens, on a token in `stop_ids` (which is not yielded), or when the caller
    sets `stopped[row]` (stop strings are the caller's: they need text). Prompts may differ in length: every row
    starts at the shortest prompt's end and keeps reading its own prompt tokens until they run out.
    """
    args, ctx = model.args, model.ctx
    lengths = [len(p) for p in prompts]
    if min(lengths) == 0:
        raise ValueError(f"prompt {lengths.index(0)} is empty after tokenization")
    if max(lengths) >= args.max_seq_len:
        raise ValueError(f"a prompt of {max(lengths)} tokens leaves no room to generate within max_seq_len "
                         f"{args.max_seq_len}")
    total_len = min(args.max_seq_len, max(lengths) + max_gen_len)
    device = model.rotations.device
    tokens = torch.zeros(len(prompts), total_len, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    in_prompt = torch.arange(total_len, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    generator = torch.Generator(device=device).manual_seed(seed)
    stopped = stopped if stopped is not None else [False] * len(prompts)
    stop_ids = set(stop_ids)

    model.setup_caches(len(prompts), total_len)
    try:
        prev = 0
        for cur in range(min(lengths), total_len):
            logits = model(tokens[:, prev:cur], prev, last_only=True)
            chosen = ctx.broadcast(sample(logits, temperature, top_p, generator).to(ctx.device)).to(device)
            tokens[:, cur] = torch.where(in_prompt[:, cur], tokens[:, cur], chosen)
            yield _settle_step(tokens[:, cur].tolist(), cur, lengths, max_gen_len, stop_ids, stopped)
            prev = cur
            if all(stopped):
                break
    finally:
        model.free_caches()


def _settle_step(step: list[int], cur: int, lengths: list[int], max_gen_len: int, stop_ids: set,
                 stopped: list[bool]) -> list[Optional[int]]:
    out = []
    for row, token in enumerate(step):
        if stopped[row] or cur < lengths[row]:
            out.append(None)
            continue
        stopped[row] = token in stop_ids or cur + 1 - lengths[row] >= max_gen_len
        out.append(None if token in stop_ids else token)
    return out
