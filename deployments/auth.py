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

from fastapi import Request
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


async def authenticate(request: Request, call_next):
    if _KEYS and needs_key(request.url.path) and not authorized(request.headers.get("authorization")):
        body = error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                          type_="invalid_request_error", code="invalid_api_key")
        return JSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})
    return await call_next(request)
