"""`accessory generate`: complete one prompt (alone or under torchrun), and the --image a prompt reads. Exit status:
0 with the text printed; 1 when the request fails while generating (its error logged: NaN logits, say); 2 for bad
input (a flag, a file, an adapter), refused before generating."""
from __future__ import annotations

import logging
import sys

from accessory.cli.options import add_image_args, add_model_args, add_sampling_args, sampling_kwargs
from accessory.cli.process import load_model


def add_generate_verb(verbs) -> None:
    gen = verbs.add_parser("generate", help="complete a prompt (run under torchrun for tensor parallelism)")
    add_model_args(gen)
    sampling = add_sampling_args(gen)
    sampling.add_argument("--prompt", required=True)
    sampling.add_argument("--chat", action="store_true",
                          help="wrap the prompt in the model's chat template; stop at its end-of-turn token")
    add_image_args(gen, "an image for a vision-language model: it goes where the prompt says <image>, else right "
                   "after BOS (with --chat: at the start of the user's message)")
    gen.set_defaults(handler=run_generate)


def run_generate(args) -> None:
    image = read_image(args)
    model = load_model(args)
    pixels = image_pixels_of(model, image, args)
    last = None
    for last in generated_events(model, pixels, args):
        pass
    exit_if_failed(last)
    if model.ctx.is_source:
        print(last.text, flush=True)


def generated_events(model, pixels, args):
    """The prompt's events (stream_generate's, or stream_chat's with --chat): the last tells whether it failed,
    which generate's and chat's texts do not."""
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        return model.stream_chat(with_image(messages, args), image=pixels, **sampling_kwargs(args))
    return model.stream_generate(args.prompt, image=pixels, **sampling_kwargs(args))


def exit_if_failed(event) -> None:
    """A request that failed (NaN logits, say) ends the verb with status 1 and its error instead of printing a
    partial text with status 0. Every rank holds the same events, so every rank leaves the group here, in step."""
    if event.finish_reason != "error":
        return
    from accessory.parallel.context import shutdown_distributed

    logging.getLogger("accessory").error("generation failed after %d token(s): %s", event.completion_tokens,
                                         event.error)
    shutdown_distributed()
    sys.exit(1)


def read_image(args):
    """--image, read by global rank 0 before any model loads (None on the other ranks, and without --image); a bad
    file stops every rank, with one message."""
    if not getattr(args, "image", None):
        return None
    from accessory.data.images import ImageError, read_image_file
    from accessory.parallel import ParallelContext

    def read():
        try:
            return read_image_file(args.image)
        except ImageError as e:
            raise ImageError(f"--image {e}") from None

    return ParallelContext.from_group(None).on_rank0(read)


def image_pixels_of(model, image, args):
    """The pixels of --image for the source rank's generation (None on the others: the source rank's are sent to
    them), or None without --image."""
    if not getattr(args, "image", None):
        return None
    from accessory.data.images import ImageError
    from accessory.runtime.images import image_pixels

    def pixels():
        if not model.llma.image_tokens:
            raise ImageError(f"--image {args.image}: this model ({model.llama_type}) reads text only; a "
                             f"vision-language checkpoint (llama_type llava) reads images")
        return image_pixels(model, lambda: image, args.image_transform, f"--image {args.image}")

    return model.ctx.on_rank0(pixels)


def with_image(messages: list[dict], args) -> list[dict]:
    """With --image, the messages with its placeholder opening the first user message (LLaVA's place for it)."""
    if not args.image:
        return messages
    from accessory.generation.chat import with_image_placeholder

    return with_image_placeholder(messages)
