"""What a request body may be, checked as it is read: no larger than the body limit (413), and UTF-8 (400)."""
from __future__ import annotations

import codecs
from typing import Callable, Optional

from starlette.exceptions import HTTPException

from accessory.serve.api_errors import APIError, error_response
from accessory.serve.images import ImageOptions
from accessory.serve.service import GenerationService


TEXT_REQUEST_BYTES = 8_000_000  # the body limit's room for text (beside one image, for a model that reads them)


def body_limit(given: Optional[int], service: Optional[GenerationService], images: ImageOptions) -> tuple[int, str]:
    """The body limit that applies now, and its name for a 413: `given` (--max-request-bytes); else 8 MB, plus one
    image at the image limit as base64 (4 characters per 3 bytes) for a model that reads images (while the model
    loads, when it is not known yet, the text model's)."""
    if given is not None:
        return given, "the server's --max-request-bytes"
    if service is None or not service.model.llma.image_tokens:
        return TEXT_REQUEST_BYTES, "the server's --max-request-bytes, by default 8MB for a model that reads text"
    return (TEXT_REQUEST_BYTES + 4 * -(-images.limits.max_bytes // 3),
            "the server's --max-request-bytes, by default 8MB for text plus one --max-image-bytes image as base64 "
            "for a model that reads images")


class BodyLimit:
    """Refuse request bodies over `limit()[0]` bytes with 413 naming the limit (`limit()[1]`): by their
    Content-Length before reading, or, for a body sent without one, as soon as the bytes read pass the limit."""

    def __init__(self, app, limit: Callable[[], tuple[int, str]]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, name = self.limit()
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        message = f"the request body is over {limit} bytes ({name})"
        if not declared.isdigit() or int(declared) > limit:
            response = error_response(APIError(413, message, code="request_too_large"), scope["path"])
            return await response(scope, receive, send)
        read = 0

        async def limited_receive():
            nonlocal read
            received = await receive()
            read += len(received.get("body", b""))
            if read > limit:  # FastAPI passes an HTTPException from reading the body on to the handlers
                raise HTTPException(413, message)
            return received

        await self.app(scope, limited_receive, send)


class Utf8Body:
    """Refuse a request body that is not UTF-8 with 400, as it is read. Python's json would read UTF-16 and UTF-32
    too (it guesses the encoding from the NUL bytes): JSON in UTF-8 holds no NUL byte."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        decoder, read = codecs.getincrementaldecoder("utf-8")(), 0

        async def checked_receive():
            nonlocal read
            received = await receive()
            chunk = received.get("body", b"")
            if b"\0" in chunk:
                raise HTTPException(400, f"the request body is not UTF-8: a NUL byte at byte {read + chunk.index(0)} "
                                         f"(UTF-16 or UTF-32?); send JSON as UTF-8")
            try:
                decoder.decode(chunk, final=not received.get("more_body", False))
            except UnicodeDecodeError as e:
                raise HTTPException(400, f"the request body is not UTF-8: {e.reason} at byte {read + e.start}")
            read += len(chunk)
            return received

        await self.app(scope, checked_receive, send)
