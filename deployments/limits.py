"""The operator's request limits at the HTTP edge: the body's size before it is read (413), then
what a parsed request may ask for (400 naming the field). The unit checks the rest (prompt
tokens, default ``max_tokens``) where the tokenizer is.

The limits live in this module, as the API keys do in ``deployments.auth``: Serve ships the
Ingress class to its replicas by value, so the middleware (imported by reference) reads them
from here.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from deployments.config import RequestLimits
from deployments.protocol import ChatCompletionRequest, error_body

_LIMITS: list[RequestLimits] = [RequestLimits()]


def set_limits(limits: RequestLimits) -> None:
    _LIMITS[0] = limits


def current() -> RequestLimits:
    return _LIMITS[0]


def _too_large(limit: int) -> str:
    return f"the request body exceeds this server's limit of {limit} bytes"


class BodyLimit:
    """ASGI middleware: a body over ``max_body_bytes`` is refused with 413 before it is parsed,
    at once when Content-Length says so, else as soon as the bytes read pass the limit."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = current().max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            body = error_body(_too_large(limit), type_="invalid_request_error", code="request_too_large")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body") or b"")
                if seen > limit:  # a chunked body: the app's exception handler answers 413
                    raise HTTPException(413, _too_large(limit))
            return message

        return await self.app(scope, counted, send)


def check_request(body, limits: RequestLimits) -> tuple[str, str] | None:
    """(param, message) for the first limit a parsed request breaks, or None."""
    messages = body.messages if isinstance(body, ChatCompletionRequest) else None  # not an extra field
    if messages is not None and len(messages) > limits.max_messages:
        return "messages", f"{len(messages)} messages; this server takes at most {limits.max_messages}"
    stops = body.stop or []
    if len(stops) > limits.max_stop_strings:
        return "stop", f"{len(stops)} stop strings; this server takes at most {limits.max_stop_strings}"
    if any(len(s) > limits.max_stop_chars for s in stops):
        return "stop", f"a stop string is longer than this server's limit of {limits.max_stop_chars} characters"
    if body.seed is not None and not -limits.max_seed - 1 <= body.seed <= limits.max_seed:
        return "seed", f"seed must lie in [{-limits.max_seed - 1}, {limits.max_seed}]"
    return None
