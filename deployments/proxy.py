"""Middleware for Ray Serve's HTTP proxy: a client cannot switch off the operator's timeouts,
and every answer the proxy gives itself is an OpenAI error object.

Ray Serve's proxy reads two request headers meant for a trusted load balancer (Ray 2.60,
``ray/serve/_private/proxy.py``): ``x-request-timeout-seconds`` replaces
``http_options.request_timeout_s`` (0 or less: no timeout at all) and
``x-request-disconnect-disabled: ?1`` keeps a request running after its client has gone. On a
server exposed to clients, either lets one caller hold a unit's slot for as long as it likes.
``DropClientOverrides`` drops both before the proxy reads them.

When the Ingress replica that holds a request dies, the proxy has nothing to send: uvicorn
answers a request not yet started with a plain-text ``500 Internal Server Error`` and cuts a
started stream mid-body; the proxy's own refusals (408 timeout, 503 backpressure) are plain
text too. ``OpenAIErrors`` turns each into what an OpenAI client can read: a JSON error object
(503 with ``Retry-After`` for a lost request, the proxy's own status otherwise), and a cut
event stream ends with an error object and ``[DONE]``, as the Ingress ends a stream whose unit
failed.

The proxy runs it when its process has, in its environment (``ray start``, the pod, or the
shell that runs ``serve run``)::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy:middlewares
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware

log = logging.getLogger("ray.serve")

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.proxy:middlewares"
CLIENT_OVERRIDES = frozenset({b"x-request-timeout-seconds", b"x-request-disconnect-disabled"})


class DropClientOverrides:
    """ASGI middleware: requests lose the headers that would override the proxy's policy."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            if any(name.lower() in CLIENT_OVERRIDES for name, _ in headers):
                scope = {**scope, "headers": [(n, v) for n, v in headers if n.lower() not in CLIENT_OVERRIDES]}
        return await self.app(scope, receive, send)


# deployments.protocol.error_body's shape, written here: importing protocol would load torch
# (through specdec.config) into every proxy process.
def _error_body(message: str, status: int, code: str) -> bytes:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


_CODES = {408: "timeout", 429: "overloaded", 503: "overloaded"}
LOST = ("the server lost this request before it was answered (its Ingress replica failed); "
        "the request can be retried")


class OpenAIErrors:
    """ASGI middleware: what the proxy answers by itself becomes an OpenAI error object, and a
    request the proxy could not finish still ends as an OpenAI client expects (module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "done": False, "stream": False, "held": None, "text": b""}

        async def tracked(message):
            kind = message["type"]
            if kind == "http.response.start":
                state["started"] = True
                headers = {n.lower(): v for n, v in message.get("headers", [])}
                content_type = headers.get(b"content-type", b"")
                state["stream"] = content_type.startswith(b"text/event-stream")
                if message["status"] >= 400 and content_type.startswith(b"text/plain"):
                    state["held"] = message  # the proxy's own refusal: rewritten when its body is in
                    return
            elif kind == "http.response.body" and state["held"] is not None:
                state["text"] += message.get("body", b"")
                if message.get("more_body"):
                    return
                await self._rewrite(send, state["held"], state["text"].decode("utf-8", "replace"))
                state["done"] = True
                return
            elif kind == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # uvicorn would log a traceback and answer 500 in plain text
            log.warning("request %s failed in the proxy: %s", scope.get("path"), type(exc).__name__)
        if state["done"]:
            return
        try:
            if not state["started"]:
                await self._send_json(send, 503, _error_body(LOST, 503, "unit_failed"), [(b"retry-after", b"1")])
            elif state["stream"]:
                body = b"data: " + _error_body(LOST, 503, "unit_failed") + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": False})
        except Exception:  # the client has gone too: nothing to tell it
            pass

    @staticmethod
    async def _send_json(send, status: int, body: bytes, extra: list) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _rewrite(self, send, start: dict, text: str) -> None:
        status = start["status"]
        keep = [(n, v) for n, v in start.get("headers", []) if n.lower() in (b"retry-after", b"x-request-id")]
        await self._send_json(send, status, _error_body(text.strip() or "the request failed", status,
                                                        _CODES.get(status, "proxy_error")), keep)


def middlewares() -> list[Middleware]:
    """The callback Ray Serve's proxy calls (see the module docstring)."""
    return [Middleware(DropClientOverrides), Middleware(OpenAIErrors)]
