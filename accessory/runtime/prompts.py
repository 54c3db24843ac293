"""From what a caller passes MetaModel to what the engine runs: prompts (with their images) encoded, checked
against the model, and made into Requests; stop strings per prompt; the events a stream shows."""
from __future__ import annotations

import secrets

from accessory.generation.sampling import SamplingParams
from accessory.generation.requests import Request, fit_prompt, row_seeds
from accessory.network.vision import optional_pixels
from accessory.text.tokenizer import IMAGE_PLACEHOLDER


def requests_for(model, prompts: list[str], images, params: SamplingParams, stop_strings, seed,
                 truncate) -> list[Request]:
    """One Request per prompt, alike on every rank: the source rank's prompts, images and seed win, so ranks cannot
    disagree even if their callers do."""
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    images = checked_images(model, images, len(prompts))
    prompts, images, seed = model.ctx.broadcast_object(
        (list(prompts), images, secrets.randbits(63) if seed is None else seed))
    stops = stops_per_prompt(stop_strings, len(prompts))
    requests = []
    for row, (prompt, image, row_seed) in enumerate(zip(prompts, images, row_seeds(seed, len(prompts)))):
        tokens = encode_prompt(model, prompt, image is not None)
        tokens = fit_prompt(tokens, params, model.llma.args.max_seq_len, truncate, row,
                            model.llma.image_tokens if image is not None else 0)
        if not tokens:
            raise ValueError(f"prompt {row} is empty after tokenization")
        requests.append(Request(row, tokens, params, row_seed, stops[row], image=image))
    return requests


def encode_prompt(model, prompt: str, image: bool = False, special: bool = True) -> list[int]:
    """The prompt's token ids, BOS first. With an image (a vision-language model), its `image_tokens` image
    tokens stand where the prompt's "<image>" placeholder is (the tokenizer's own token, or text that LLaVA's
    code splits the prompt at), or right after BOS if it has none, as LLaMA2-Accessory places visual tokens.
    `special=False`: special tokens' text is plain text."""
    ids = model.tokenizer.encode(prompt, bos=True, eos=False, special=special)
    llma = model.llma
    if not image:
        if llma.image_tokens and (llma.image_token in ids or IMAGE_PLACEHOLDER in prompt):
            raise ValueError(f"the prompt holds the image placeholder {IMAGE_PLACEHOLDER!r} but no image was "
                             f"given")
        return ids
    if not llma.image_tokens:
        raise ValueError(f"an image was given, but this model ({model.llama_type}) reads text only")
    image_ids = [llma.image_token] * llma.image_tokens
    if llma.image_token in ids or IMAGE_PLACEHOLDER not in prompt:
        if ids.count(llma.image_token) > 1:
            raise ValueError(f"the prompt holds {ids.count(llma.image_token)} image placeholders; it takes one "
                             f"image")
        at = ids.index(llma.image_token) if llma.image_token in ids else int(ids[:1] == [model.tokenizer.bos_id])
        return ids[:at] + image_ids + ids[at + (llma.image_token in ids):]
    pieces = model.tokenizer.encode_pieces(prompt, IMAGE_PLACEHOLDER, bos=True, special=special)
    if len(pieces) > 2:
        raise ValueError(f"the prompt holds {len(pieces) - 1} {IMAGE_PLACEHOLDER!r} placeholders; it takes one "
                         f"image")
    return pieces[0] + image_ids + pieces[1]


def image_transform(model, name: str = "padded_resize"):
    """PIL image -> pixels for this model: `accessory.data.transform.get_transform(name, image_size)` with the
    model's own normalisation. "padded_resize" (default) pads to a square first, as LLaVA-1.5 was trained;
    "resized_center_crop" crops the middle square."""
    from accessory.data.transform import get_transform

    if not model.llma.image_tokens:
        raise ValueError(f"this model ({model.llama_type}) reads text only: it has no image transform")
    args = model.llma.args
    return get_transform(name, model.llma.image_size, mean=tuple(args.image_mean), std=tuple(args.image_std))


def checked_images(model, images, count: int) -> list:
    """`images` as one entry per prompt (pixels or None), checked against the model."""
    if images is None:
        return [None] * count
    if not model.llma.image_tokens:
        raise ValueError(f"images were given, but this model ({model.llama_type}) reads text only: a "
                         f"vision-language checkpoint (llama_type 'llava') reads images")
    channels = model.llma.args.vision["num_channels"]
    return optional_pixels(images, count, channels, model.llma.image_size, "images")


def stops_per_prompt(stop_strings, n: int) -> list[list[str]]:
    """One list of stop strings for every prompt, or a list of lists (one per prompt), as n lists."""
    stop_strings = list(stop_strings)
    if stop_strings and all(isinstance(s, (list, tuple)) for s in stop_strings):
        if len(stop_strings) != n:
            raise ValueError(f"{len(stop_strings)} lists of stop symbols for {n} prompts; give one per prompt")
        return [list(s) for s in stop_strings]
    if any(not isinstance(s, str) for s in stop_strings):
        raise ValueError("additional_stop_symbols must be strings, or one list of strings per prompt")
    return [stop_strings] * n


def changed_events(steps, batch: bool):
    """The events of a single prompt as they change (ending with end_of_content), or batch steps that changed."""
    ended = None
    for events in steps:
        now = [e.end_of_content for e in events]
        if any(e.delta for e in events) or now != ended:
            yield list(events) if batch else events[0]
        ended = now
