"""The API's errors: APIError carries the status and the fields, error_body and error_response write them in the
shape of the API that was called (OpenAI's {"error": {"message", "type", "param", "code"}}, or under /v1/messages
Anthropic's {"type": "error", "error": {"type", "message"}}), generation_failed words a request that failed while
decoding."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from accessory.generation.constraints import ConstraintError
from accessory.generation.requests import Event


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


def error_response(error: APIError, path: str) -> JSONResponse:
    """The error as the API at `path` (the request's) words it."""
    return JSONResponse(error_body(error, path), status_code=error.status, headers=error.headers)


def error_body(error: APIError, path: str) -> dict:
    if path.startswith(ANTHROPIC_PATH):
        return {"type": "error", "error": {"type": ANTHROPIC_KINDS.get(error.status, "api_error"),
                                           "message": error.message}}
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def generation_failed(final: Event, constraint_field: Optional[str]) -> APIError:
    """A request that ended with finish_reason "error" (the others, and the server, went on): a 400 naming the
    field when the grammar engine refused its constraint while decoding, else a 500."""
    if final.error.startswith(REFUSED_CONSTRAINT):  # its message says after how many tokens
        return APIError(400, f"{constraint_field}: {final.error[len(REFUSED_CONSTRAINT):]}", param=constraint_field)
    return APIError(500, f"generation failed after {final.completion_tokens} token(s): {final.error}",
                    kind="server_error")


REFUSED_CONSTRAINT = f"{ConstraintError.__name__}: "  # how the scheduler words a row's ConstraintError
