"""`accessory chat`: a multi-turn chat in the terminal; rank 0 reads it and every rank generates."""
from __future__ import annotations

import signal
import sys
import threading

from accessory.cli.generate import image_pixels_of, read_image, with_image
from accessory.cli.options import add_image_args, add_model_args, add_sampling_args, sampling_kwargs
from accessory.cli.process import load_model


def add_chat_verb(verbs) -> None:
    chat = verbs.add_parser("chat", help="multi-turn chat in the terminal (rank 0 reads it under torchrun)")
    add_model_args(chat)
    sampling = add_sampling_args(chat)
    sampling.add_argument("--template", help="a LLaMA2-Accessory conversation template name (default: the "
                          "model's own chat template)")
    sampling.add_argument("--system", help="system message for every conversation")
    add_image_args(chat, "an image for a vision-language model: every conversation is about it (it opens the first "
                   "user message, again after /reset)")
    chat.set_defaults(handler=run_chat)


CHAT_HELP = "Type a message and press Enter. /reset starts a new conversation, /exit (or Ctrl-D) quits."


def run_chat(args) -> None:
    """Rank 0 reads the terminal and broadcasts each line; every rank generates; rank 0 streams the reply."""
    image = read_image(args)
    model = load_model(args)
    pixels = image_pixels_of(model, image, args)
    source = model.ctx.is_source
    # The terminal's Ctrl-C reaches every rank; the source turns it into a clean end for all, even if this process
    # was started with SIGINT ignored (Python then keeps it ignored, and Ctrl-C at the prompt would do nothing).
    signal.signal(signal.SIGINT, signal.default_int_handler if source else signal.SIG_IGN)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if source:
        print(CHAT_HELP, flush=True)
    while True:
        line = next_line(model.ctx)
        if line is None or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(system)
            if source:
                print("(new conversation)", flush=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for event in model.stream_chat(with_image(messages, args), template=args.template, image=pixels,
                                       **sampling_kwargs(args)):
            reply = event.text
            if source:
                print(event.delta, end="", flush=True)
        if source:
            print(flush=True)
        messages.append({"role": "assistant", "content": reply})


KEEPALIVE_S = 30.0  # while the user types, how often the source rank tells the others it is still waiting


STILL_WAITING = ("still waiting",)


def next_line(ctx):
    """The user's next line (None to end) on every rank. The other ranks wait for it in a collective, which would
    time out if the user took long: meanwhile the source rank sends a keep-alive from a thread. The main thread does
    the reading, so the terminal's Ctrl-C interrupts the read itself (Python runs signal handlers there)."""
    if not ctx.is_source:
        while True:
            line = ctx.broadcast_object(None)
            if line != STILL_WAITING:
                return line
    if ctx.world_size == 1:
        return read_line("user> ")
    with KeepAlive(ctx):
        line = read_line("user> ")
    return ctx.broadcast_object(line)


class KeepAlive:
    """While the source rank waits for the user, tell the other ranks every KEEPALIVE_S that it is still waiting;
    leaving the block stops it before the next broadcast (so the line itself follows in order)."""

    def __init__(self, ctx):
        self.ctx, self.stopped, self.sending = ctx, threading.Event(), threading.Lock()
        self.thread = threading.Thread(target=self._run, name="accessory-keepalive", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(KEEPALIVE_S):
            with self.sending:
                if not self.stopped.is_set():
                    self.ctx.broadcast_object(STILL_WAITING)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def read_line(prompt: str):
    """A line from the terminal, or None on Ctrl-D / Ctrl-C (then every rank ends cleanly)."""
    # Not input(): without the readline module it writes the prompt to stderr, where logs go.
    print(prompt, end="", flush=True)
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line:
        print(flush=True)
        return None
    return line.rstrip("\n")
