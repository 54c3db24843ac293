"""`accessory serve`: every rank drives the batch in its main thread; the source rank also runs the HTTP server
(uvicorn) in a thread beside it, so the API answers while the model computes. The HTTP server starts before the
model loads: /health says 503 "loading" until it is ready, with the phase ("loading weights", then with --compile
"compiling", every graph the engine runs), and "draining" once shutdown begins."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from accessory.errors import FailedInStep
from accessory.parallel.context import world_rank
from accessory.serve.service import GenerationService

log = logging.getLogger(__name__)


def serve(load: Callable[[], object], host: str = "127.0.0.1", port: int = 8000, model_name: str = "default",
          api_key: Optional[str] = None, template: Optional[str] = None, max_queue: int = 64,
          grace_s: float = 30.0, max_request_bytes: Optional[int] = None, special_tokens_in_prompt: bool = False,
          keepalive_s: float = 10.0, images=None, tool_call_parser: str = "auto",
          reasoning_parser: str = "auto") -> None:
    """Load the model with `load()` (on every rank) and serve it until SIGTERM or SIGINT (then finish what runs,
    for up to grace_s, and return on every rank). `images`: how chat messages' images are read (an
    `images.ImageOptions`; default: its defaults)."""
    from accessory.serve.routes import ServiceSlot
    from accessory.serve.images import ImageOptions

    slot, server, thread = ServiceSlot(), None, None
    if world_rank() == 0:  # the source rank of the whole world, which serve uses
        server, thread = _start_http(slot, host, port, model_name, api_key, template,
                                     dict(max_request_bytes=max_request_bytes, keepalive_s=keepalive_s,
                                          special_tokens_in_prompt=special_tokens_in_prompt,
                                          images=images or ImageOptions(), tool_call_parser=tool_call_parser,
                                          reasoning_parser=reasoning_parser))
    model = load()
    if server is not None:
        log_tool_calls(model, tool_call_parser, reasoning_parser)
    slot.phase = "compiling"
    model.warm_up()  # with --compile: every graph before /health says ok (a no-op without)
    service = GenerationService(model, max_queue=max_queue, grace_s=grace_s, metrics=True)
    service.install_signal_handlers()
    if server is not None:
        if server.started:  # it listens until run() ends: while draining, /health says so and new requests get 503
            slot.service = service
            log.info("serving %s on http://%s:%d/v1 (model-parallel size %d)", model_name, host, port,
                     service.ctx.world_size)
        else:  # the other ranks already wait for plans: end them cleanly, then report
            service.shutdown()
    try:
        service.run()
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
    if server is not None and not server.started:
        raise FailedInStep(f"could not listen on {host}:{port} (is the port in use? pass --port); see the log "
                           f"above")


def log_tool_calls(model, parser: str, reasoning_parser: str) -> None:
    from accessory.text.reasoning import reasoning_format
    from accessory.text.tool_calls import call_format

    thinking = reasoning_format(reasoning_parser, model.tokenizer.chat_template_text)
    if thinking is not None:
        log.info("reasoning: %s ... %s kept apart as reasoning_content (%s)", thinking.start, thinking.end,
                 "--reasoning-parser" if reasoning_parser != "auto" else "the chat template's markers")
    fmt = call_format(parser, model.tokenizer.chat_template_text)
    if fmt is None:
        log.info("tool calls: the chat template writes no format this server reads (--tool-call-parser names one); "
                 "a reply to a request with tools is plain content")
    else:
        log.info("tool calls: read as %s (%s)", fmt.name, "--tool-call-parser" if parser != "auto" else
                 "the chat template's markup")


def _start_http(slot, host: str, port: int, model_name: str, api_key: Optional[str], template: Optional[str],
                limits: dict):
    import uvicorn

    from accessory.serve.api import create_app

    app = create_app(slot, model_name, api_key, template, **limits)
    # log_config=None: uvicorn's loggers use ours (timestamps, rank); each request has its own line (metrics.py)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    return server, thread
