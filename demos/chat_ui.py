"""What the two gradio chat demos share: their flags, the settings panel, the streamed reply, and the launch.

Every rank loads the model and runs the generation service in its main thread; only the model-parallel source rank
serves the page, and its requests reach the other ranks through the service's broadcasts. A demo script only says
which messages the model sees for a question (`single_turn.py`: the question alone; `multi_turn.py`: the whole
conversation), and whether the page takes an image (`*_mm.py`, for a vision-language checkpoint).
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable, Iterator, Optional

from accessory import cli, config_file
from accessory.data.conversation import template_names
from accessory.errors import ConfigError, FailedInStep

log = logging.getLogger("accessory.demos")

MODEL_TEMPLATE = "(the model's own chat template)"  # the template dropdown's first choice: template=None
# Replies streamed at once, one gradio worker thread each; the service batches them. More wait in gradio's queue.
CONCURRENT_REPLIES = 32
FINISHED = {"stop": "Done", "length": "Cut at max_gen_len", "cancelled": "Stopped", "error": "Failed"}
NEEDS_IMAGES = ("this demo reads images: it needs a vision-language checkpoint (llama_type 'llava', e.g. an HF LLaVA "
                "folder imported with `accessory convert hf`)")

# An OpenAI-style message list: [{"role": "system" | "user" | "assistant", "content": str}, ...]
Messages = list[dict]
# Which messages the model sees when answering the last user message of a conversation (system prompt apart).
Context = Callable[[Messages], Messages]


def parse_args(description: str, argv=None, image: bool = False) -> argparse.Namespace:
    """The demo's flags; `image`: the page takes an image, and args.image_transform names how it becomes pixels
    (None on a text demo)."""
    parser = argparse.ArgumentParser(description=description)
    cli.add_model_args(parser)
    cli.add_sampling_args(parser)  # their values are the settings panel's initial values
    page = parser.add_argument_group("page")
    page.add_argument("--host", default="127.0.0.1", help="address to serve the page on (0.0.0.0: every interface)")
    page.add_argument("--port", type=cli.positive_int, default=7860)
    page.add_argument("--template", choices=template_names(),
                      help="LLaMA2-Accessory conversation template selected at start (default: the model's own)")
    page.add_argument("--system", default="", help="system message selected at start")
    if image:
        from accessory.data.transform import TRANSFORMS

        page.add_argument("--image_transform", choices=TRANSFORMS, default="padded_resize",
                          help="how an uploaded image becomes the model's square input: padded_resize pads it to a "
                          "square first (as LLaVA-1.5 was trained), resized_center_crop crops its middle square")
    else:
        parser.set_defaults(image_transform=None)
    # As `accessory serve`: the service keeps a KV cache of max_batch_size x max_seq_len tokens for as long as it
    # runs (at 32 x 4096: 5.6 GiB for the built-in 135M model in float32 on one rank), so smaller defaults here.
    parser.set_defaults(max_seq_len=2048, max_batch_size=16)
    cli.both_spellings(parser)
    args = config_file.parse_args(parser, argv)
    if image and not args.pretrained_path:  # refused before the built-in model is imported and loaded
        parser.error(f"{NEEDS_IMAGES}; pass it with --pretrained_path (the built-in SmolLM2-135M-Instruct reads "
                     "text only)")
    return args


def main(title: str, context: Context, argv=None, image: bool = False) -> None:
    """Load the model on every rank, serve the page from the source rank, and return on every rank once the
    service is shut down (SIGTERM or SIGINT to the source rank; Ctrl-C in torchrun's terminal reaches it too).
    `image`: the page takes an image, which the model sees with the conversation."""
    args = parse_args(title, argv, image)
    cli.run(lambda parsed: serve(title, context, parsed), args)


def serve(title: str, context: Context, args: argparse.Namespace) -> None:
    """Serve until the service shuts down. If the source rank cannot open the page, every rank still leaves the
    service together, and then the source rank reports it."""
    from accessory.serve.service import GenerationService

    model = cli.load_model(args, warmup=True)
    images = None if args.image_transform is None else image_reader(model, args)  # before the page is served
    service = GenerationService(model)
    service.install_signal_handlers()
    page = failure = None
    if model.ctx.is_source:
        try:
            page = launch(build_page(title, service, context, args, describe(model, args), images), args)
        except Exception as e:  # e.g. the port is taken: the other ranks already wait in run(); end them cleanly
            failure = e
            service.shutdown()
    try:
        service.run()
    finally:
        if page is not None:  # after run(): open replies end first, then the page closes
            page.close()
    if failure is not None:
        raise FailedInStep(f"could not serve the page on {args.host}:{args.port} (is the port in use? pass "
                           f"--port): {failure}")


def describe(model, args: argparse.Namespace) -> str:
    from pathlib import Path

    name = Path(args.pretrained_path[-1]).name if args.pretrained_path else "the built-in SmolLM2-135M-Instruct"
    ranks = model.ctx.world_size
    return f"{name} at {ranks} model-parallel rank{'s' if ranks > 1 else ''}"


def image_reader(model, args: argparse.Namespace) -> Callable:
    """upload -> pixels for `model` (see `read_image`); raises ConfigError on every rank if `model` reads text only."""
    if not model.llma.image_tokens:
        raise ConfigError(f"{NEEDS_IMAGES}; {args.pretrained_path[-1]} holds a text model (llama_type "
                          f"{model.llama_type!r})")
    transform = model.image_transform(args.image_transform)
    return lambda upload: read_image(upload, transform)


def read_image(upload, transform):
    """The pixels of an uploaded image file (gradio's copy of it), or None without one. Its bytes and pixels are held
    to the limits the server's images are (accessory.data.images.ImageLimits) before any pixel is decoded."""
    import gradio as gr

    from accessory.data.images import ImageError, read_image_file

    if upload is None:
        return None
    try:
        return transform(read_image_file(upload))
    except ImageError as e:
        raise gr.Error(f"the image cannot be used: {e}") from None


def launch(page, args: argparse.Namespace):
    import gradio as gr

    from accessory.data.images import ImageLimits

    # System fonts: the default theme's web fonts would be fetched from the internet by every browser.
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "monospace"])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up requests, one line each
    # max_file_size: gradio stores any upload to its upload endpoint (open on every page) before a handler sees it
    page.queue(default_concurrency_limit=CONCURRENT_REPLIES).launch(
        server_name=args.host, server_port=args.port, prevent_thread_lock=True, ssr_mode=False, show_error=True,
        max_threads=CONCURRENT_REPLIES + 8, theme=theme, footer_links=[], quiet=True,
        max_file_size=ImageLimits().max_bytes)
    log.info("demo page: http://%s:%d", args.host, args.port)
    return page


def build_page(title: str, service, context: Context, args: argparse.Namespace, about: str,
               images: Optional[Callable] = None):
    """The chat column (conversation, message box, Submit / Stop / Undo / Clear) beside the settings column, with
    an image box above the settings if `images` (upload -> pixels) is given."""
    import gradio as gr

    with gr.Blocks(title=title, analytics_enabled=False) as page:
        gr.Markdown(f"## {title}\n{about}")
        history = gr.State([])  # the conversation as the model sees it; the chatbot only displays it
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(elem_id="chatbot", label="conversation", height=420, feedback_options=None,
                                     buttons=["copy", "copy_all"])
                status = gr.Markdown("", elem_id="status")
                # lines=1: gradio sends on Enter (Shift+Enter: a new line); with lines > 1 it is the other way round
                message = gr.Textbox(elem_id="message", label="message", lines=1, max_lines=10, autofocus=True,
                                     placeholder="Type a message; Enter sends it, Shift+Enter starts a new line")
                with gr.Row():
                    submit = gr.Button("Submit", variant="primary", elem_id="submit")
                    stop = gr.Button("Stop", elem_id="stop")
                    undo = gr.Button("Undo", elem_id="undo")
                    clear = gr.Button("Clear", elem_id="clear")
            with gr.Column(scale=2):
                # type="filepath", image_mode=None: gradio hands over its copy of the file undecoded, for
                # read_image to check its size first
                uploads = [gr.Image(type="filepath", image_mode=None, label="image (a new one starts a new "
                                    "conversation)", elem_id="image", height=280)] if images else []
                settings = settings_panel(args)

        def reply(text, messages, *values):
            image = None
            if images is not None:
                upload, *values = values
                image = images(upload)
            yield from stream_reply(service, context, text, messages, image, *values)

        answering = gr.on([message.submit, submit.click], reply, [message, history, *uploads, *settings],
                          [message, history, chatbot, status], concurrency_limit=CONCURRENT_REPLIES,
                          trigger_mode="once")
        # Cancelling the reply closes its generator, which cancels the request and frees its batch row.
        stop.click(lambda: "Stopped.", None, status, cancels=[answering])
        undo.click(undo_last, history, [history, chatbot, status], cancels=[answering])
        # the chatbot's own trash icon clears only what it shows: clear the history with it
        gr.on([clear.click, chatbot.clear], lambda: ([], [], ""), None, [history, chatbot, status],
              cancels=[answering])
        for upload in uploads:  # one image belongs to one conversation: the answers so far were about the last one
            upload.change(new_image, upload, [history, chatbot, status], cancels=[answering])
    return page


def settings_panel(args: argparse.Namespace) -> list:
    """The template, system message and sampling controls, in `stream_reply`'s argument order."""
    import gradio as gr

    gr.Markdown("### Settings")
    template = gr.Dropdown([MODEL_TEMPLATE, *template_names()], value=args.template or MODEL_TEMPLATE,
                           label="conversation template")
    system = gr.Textbox(args.system, label="system message", placeholder="none")
    max_gen_len = gr.Slider(1, args.max_seq_len, min(args.max_gen_len, args.max_seq_len), step=1,
                            label="max_gen_len (tokens per answer)")
    temperature = gr.Slider(0, 2, args.temperature, step=0.05, label="temperature (0: greedy)")
    top_p = gr.Slider(0.01, 1, args.top_p, step=0.01, label="top_p")
    top_k = gr.Slider(0, 200, args.top_k, step=1, label="top_k (0: off)")
    repetition_penalty = gr.Slider(min(1.0, args.repetition_penalty), 2, args.repetition_penalty, step=0.05,
                                   label="repetition_penalty (1: off)")
    # a textbox, not gr.Number: the browser shows an empty Number as 0, and empty must mean "a new seed"
    seed = gr.Textbox("" if args.seed is None else str(args.seed), label="seed (empty: a new one for each answer)",
                      placeholder="random")
    return [template, system, max_gen_len, temperature, top_p, top_k, repetition_penalty, seed]


def stream_reply(service, context: Context, text: str, history: Messages, image, template: str, system: str,
                 max_gen_len, temperature, top_p, top_k, repetition_penalty, seed) -> Iterator[tuple]:
    """Add the user's message, then stream the answer: yields (message box, history, chatbot, status). `image`:
    pixels from `read_image`, or None."""
    if not text.strip():
        yield text, history, display(history), ""
        return
    sampling = dict(max_gen_len=int(max_gen_len), temperature=float(temperature), top_p=float(top_p),
                    top_k=int(top_k), repetition_penalty=float(repetition_penalty), seed=parse_seed(seed))
    history = [*history, {"role": "user", "content": text}]
    messages = ([{"role": "system", "content": system}] if system.strip() else []) + context(history)
    if image is not None:
        messages = with_placeholder(messages)
    # Submitted before the page changes: a refusal (a bad seed, a full queue) leaves the message in its box.
    handle = submit(service, messages, sampling, None if template == MODEL_TEMPLATE else template, image)
    finish = None
    try:
        yield "", history, display(history), "Answering..."
        for event in handle:
            answered = [*history, {"role": "assistant", "content": event.text}]
            finish = event.finish_reason
            yield "", answered, display(answered), status_line(event)
    finally:
        if finish is None:  # closed early (Stop, Undo, Clear, the browser left): free the row now
            handle.cancel()


def with_placeholder(messages: Messages) -> Messages:
    """`messages` with the image's placeholder in front of the first user message: the image is seen once, before
    the conversation about it (or the single question), where LLaVA's training data put it."""
    from accessory.text.tokenizer import IMAGE_PLACEHOLDER

    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    marked = {**messages[first], "content": f"{IMAGE_PLACEHOLDER}\n{messages[first]['content']}"}
    return [*messages[:first], marked, *messages[first + 1:]]


def submit(service, messages: Messages, sampling: dict, template, image):
    """The service's handle for the request, or a gradio error (a message on the page) saying why it refused."""
    import gradio as gr

    from accessory.serve.service import QueueFull, ServiceClosed

    try:
        return service.submit_chat(messages, sampling, template=template, image=image)
    except (ValueError, QueueFull, ServiceClosed) as e:  # e.g. a prompt longer than max_seq_len
        raise gr.Error(str(e)) from None


def status_line(event) -> str:
    if event.finish_reason is None:
        return "Answering..."
    tokens = event.completion_tokens
    error = f": {event.error}" if event.error else ""
    return f"{FINISHED[event.finish_reason]} ({tokens} token{'' if tokens == 1 else 's'}){error}."


def parse_seed(text: str):
    if not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        import gradio as gr

        raise gr.Error(f"seed must be an integer or empty (a new seed for each answer), got {text!r}") from None


def new_image(upload) -> tuple:
    """A new conversation: (history, chatbot, status)."""
    return [], [], "A new conversation about this image." if upload else "A new conversation, without an image."


def undo_last(history: Messages) -> tuple:
    """Remove the last exchange: the last user message and the answer after it, if any."""
    users = [i for i, m in enumerate(history) if m["role"] == "user"]
    history = history[:users[-1]] if users else []
    return history, display(history), ""


def display(history: Messages) -> list[dict]:
    # Content as text parts: gradio passes a bare string through inspect.cleandoc, which would strip the
    # indentation of code in an answer.
    return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in history]
