"""`accessory serve`: every rank drives the batch in its main thread; the source rank also runs the HTTP server
(uvicorn) in a thread beside it, so the API answers while the model computes."""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from accessory.errors import FailedInStep
from accessory.serve.engine import GenerationService

log = logging.getLogger(__name__)


def serve(model, host: str = "127.0.0.1", port: int = 8000, model_name: str = "default",
          api_key: Optional[str] = None, template: Optional[str] = None, max_queue: int = 64,
          grace_s: float = 30.0, max_request_bytes: int = 8_000_000, special_tokens_in_prompt: bool = False) -> None:
    """Serve until SIGTERM or SIGINT (then finish what runs, for up to grace_s, and return on every rank)."""
    service = GenerationService(model, max_queue=max_queue, grace_s=grace_s)
    service.install_signal_handlers()
    server = thread = None
    if model.ctx.is_source:
        server, thread = _start_http(service, host, port, model_name, api_key, template,
                                     dict(max_request_bytes=max_request_bytes,
                                          special_tokens_in_prompt=special_tokens_in_prompt))
    try:
        service.run()
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=10)
    if server is not None and not server.started:
        raise FailedInStep(f"could not listen on {host}:{port} (is the port in use? pass --port); see the log "
                           f"above")


def _start_http(service: GenerationService, host: str, port: int, model_name: str, api_key: Optional[str],
                template: Optional[str], limits: dict):
    import uvicorn

    from accessory.serve.api import create_app

    app = create_app(service, model_name, api_key, template, **limits)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", lifespan="off"))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:  # the other ranks already wait for plans: end them cleanly, then report
        service.shutdown()
    else:
        service.shutdown_hooks.append(lambda: setattr(server, "should_exit", True))
        log.info("serving %s on http://%s:%d/v1 (model-parallel size %d)", model_name, host, port,
                 service.ctx.world_size)
    return server, thread
