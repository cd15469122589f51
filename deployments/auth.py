"""Optional API keys for the HTTP API, as vLLM's ``--api-key``: every ``/v1`` route needs
``Authorization: Bearer <key>`` (401 otherwise, before the body is even parsed); ``/health``
does not.

The keys live in this module, not in the Ingress's: Serve ships the deployment class to its
replicas by value, so state set from its ``__init__`` must go through an imported module for
the middleware (imported by reference) to see it.
"""

from __future__ import annotations

import hmac
import os

from fastapi.responses import JSONResponse

from deployments.protocol import error_body

_KEYS: list[bytes] = []


def api_keys(configured: list[str] | None) -> list[str]:
    """The keys in force: the app's ``api_keys`` and SPECDEC_API_KEY (comma-separated)."""
    keys = list(configured or []) + os.environ.get("SPECDEC_API_KEY", "").split(",")
    return [k.strip() for k in keys if k.strip()]


def set_keys(keys: list[str]) -> None:
    _KEYS[:] = [k.encode() for k in keys]


def authorized(header: str | None) -> bool:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    given = token.strip().encode()
    # Every key compared in constant time: no early exit that a timing could reveal.
    return any([hmac.compare_digest(given, key) for key in _KEYS])


def needs_key(path: str) -> bool:
    """Every route of the OpenAI API (under any route prefix); not /health."""
    return "/v1/" in path or path.endswith("/v1")


class Authenticate:
    """ASGI middleware: a ``/v1`` request without a valid key gets 401 before its body is read.

    A plain ASGI class, not a ``BaseHTTPMiddleware`` (``app.middleware("http")``): that one
    pipes every response through a memory stream and a task group of its own, per streamed
    chunk, and on a small CPU node that per-chunk work competes with the model for the cores.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _KEYS and needs_key(scope["path"]):
            header = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
            if not authorized(header.decode("latin-1")):
                body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                  type_="invalid_request_error", code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
