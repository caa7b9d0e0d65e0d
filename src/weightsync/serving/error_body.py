"""The one shape of every HTTP error a rollout server sends, whatever its engine (vLLM's
`ErrorResponse`):

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

The message is plain text, never a Python repr; `type` names the kind as vLLM does (the class
name the `openai` client raises for that status, where it has one). A 503 also names the
server's `state` beside `error`, so a client can tell "waiting for weights" from "dirty", and
carries `Retry-After` (seconds) unless the state is "failed" (an engine gone for good): HTTP
clients, the official `openai` client among them, wait that long before they try again.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["ERROR_TYPES", "RETRY_AFTER_S", "error", "error_body", "error_type"]

RETRY_AFTER_S = 2
"""A 503's `Retry-After`: with the gate's default wait (`ServeConfig.ready_timeout`, 8 s) the
`openai` client's default two retries report a server with no weights in 3 x 8 + 2 x 2 = 28 s."""

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
"""HTTP status -> error type; any other status is named by its HTTP phrase, as vLLM names it."""


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def error_body(status: int, message: str, param: str | None = None, state: str | None = None) -> dict[str, Any]:
    """The JSON object of an error response (also the `data:` of an error event mid-stream)."""
    body: dict[str, Any] = {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}
    if state is not None:
        body["state"] = state
    return body


def error(status: int, message: str, param: str | None = None, state: str | None = None) -> JSONResponse:
    retry = status == 503 and state != "failed"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return JSONResponse(error_body(status, message, param, state), status_code=status, headers=headers)
