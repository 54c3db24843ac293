"""Scoring for MetaModel: logits of every position of texts or token ids (with images), LLaMA2-Accessory's
evaluation metrics, the likeliest next tokens."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from accessory.network.vision import ImagePlacement
from accessory.runtime.prompts import checked_images, encode_prompt


def compute_logits(model, examples: Sequence[Union[str, list[int]]], images=None, bos: bool = True,
                   eos: bool = False) -> list[torch.Tensor]:
    """Float32 logits (len_i, vocab) for every position of each example (text, or token ids). `images` as
    `generate` takes them: a text example's image goes where `encode_prompt` puts it; a token-id example must
    already hold its `image_tokens` image tokens."""
    images = model.ctx.broadcast_object(checked_images(model, images, len(examples)) if images is not None else None)
    return logits_of(model, tokenized(model, examples, bos, eos, images), images)


def logits_of(model, examples: list[list[int]], images: Optional[list]) -> list[torch.Tensor]:
    """`compute_logits` of token ids (each rank's alike) and their checked images (or None)."""
    images = images or [None] * len(examples)
    logits = []
    for start in range(0, len(examples), model.max_batch_size):
        wave = examples[start: start + model.max_batch_size]
        # right padding: causal attention never lets a real token see the padding after it
        tokens = torch.zeros(len(wave), max(map(len, wave)), dtype=torch.long, device=model.llma.device)
        for row, ids in enumerate(wave):
            tokens[row, :len(ids)] = torch.tensor(ids)
        placements = [ImagePlacement(row, 0, len(ids), image)
                      for row, (ids, image) in enumerate(zip(wave, images[start:])) if image is not None]
        llma = model.llma
        out = llma.stage.from_last(llma.through(llma, tokens, placements), (*tokens.shape, llma.args.vocab_size))
        logits += [out[row, :len(ids)] for row, ids in enumerate(wave)]
    return logits


def evaluate_examples(model, examples: Sequence[Union[str, list[int]]],
                      contexts: Optional[Sequence[Union[str, list[int]]]] = None, images=None, bos: bool = True,
                      eos: bool = False) -> dict[str, list]:
    """LLaMA2-Accessory's metrics of each example's tokens after its context (all but the first if none).

    Returns lists, one item per example: "log_likelihood" (sum of token log-probs), "ppl" (mean negative
    log-likelihood per token, LLaMA2-Accessory's name for it), "perplexity" (exp of that), "max_equal" (greedy
    decoding reproduces every token), "non_context_logits" (the logits that predict those tokens).
    """
    images = model.ctx.broadcast_object(checked_images(model, images, len(examples)) if images is not None else None)
    tokens = tokenized(model, examples, bos, eos, images)
    context_tokens = tokenized(model, contexts, bos, False, images) if contexts is not None else None
    if context_tokens is not None:
        if len(context_tokens) != len(tokens):
            raise ValueError(f"{len(tokens)} examples but {len(context_tokens)} contexts")
        for i, (example, context) in enumerate(zip(tokens, context_tokens)):
            if example[:len(context)] != context or not context:
                raise ValueError(f"context {i} is empty or is not the start of example {i} once tokenized")
    result = {"log_likelihood": [], "ppl": [], "perplexity": [], "max_equal": [], "non_context_logits": []}
    for i, logits in enumerate(logits_of(model, tokens, images)):
        start = len(context_tokens[i]) - 1 if context_tokens is not None else 0
        predicting = logits[start:-1]
        labels = torch.tensor(tokens[i][start + 1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(predicting, labels, reduction="none")
        result["log_likelihood"].append(-nll.sum().item())
        result["ppl"].append(nll.mean().item())
        result["perplexity"].append(nll.mean().exp().item())
        result["max_equal"].append(bool((predicting.argmax(-1) == labels).all()))
        result["non_context_logits"].append(predicting)
    return result


def next_token_probs(model, prompt: str, top_k: int = 10, temperature: float = 1.0) -> list[tuple[str, float, int]]:
    """The `top_k` likeliest next tokens after `prompt`: [(token_text, probability, token_id), ...], most likely
    first, probabilities from softmax(logits / temperature) over the whole vocabulary."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")
    [logits] = compute_logits(model, [prompt])
    probs = torch.softmax(logits[-1] / temperature, dim=-1)
    values, ids = probs.topk(min(top_k, probs.numel()))
    return [(model.tokenizer.decode([i]), p, i) for p, i in zip(values.tolist(), ids.tolist())]


def tokenized(model, examples, bos: bool, eos: bool, images=None) -> list[list[int]]:
    if isinstance(examples, str) or not examples:
        raise ValueError("examples must be a non-empty list of texts or token-id lists")
    examples = model.ctx.broadcast_object(list(examples))
    images = images or [None] * len(examples)
    tokens = [(encoded_example(model, e, bos, eos, image is not None) if isinstance(e, str) else list(e))
              for e, image in zip(examples, images)]
    for i, (ids, image) in enumerate(zip(tokens, images)):
        held, wanted = ids.count(model.llma.image_token), model.llma.image_tokens if image is not None else 0
        if model.llma.image_tokens and held != wanted:
            raise ValueError(f"example {i} holds {held} image tokens ({model.llma.image_token}); with "
                             f"{'its' if image is not None else 'no'} image it must hold {wanted}")
    for i, ids in enumerate(tokens):
        if not 0 < len(ids) <= model.llma.args.max_seq_len:
            raise ValueError(f"example {i} has {len(ids)} tokens; scoring needs 1 to max_seq_len "
                             f"({model.llma.args.max_seq_len})")
    return tokens


def encoded_example(model, text: str, bos: bool, eos: bool, image: bool) -> list[int]:
    if not image:
        return model.tokenizer.encode(text, bos, eos)
    ids = encode_prompt(model, text, image=True)
    return (ids if bos else ids[1:]) + ([model.tokenizer.eos_id] if eos else [])
