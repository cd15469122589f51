"""Middleware for Ray Serve's HTTP proxy: a client cannot switch off the operator's timeouts.

Ray Serve's proxy reads two request headers meant for a trusted load balancer (Ray 2.60,
``ray/serve/_private/proxy.py``): ``x-request-timeout-seconds`` replaces
``http_options.request_timeout_s`` (0 or less: no timeout at all) and
``x-request-disconnect-disabled: ?1`` keeps a request running after its client has gone. On a
server exposed to clients, either lets one caller hold a unit's slot for as long as it likes.
This middleware drops both before the proxy reads them.

The proxy runs it when its process has, in its environment (``ray start``, the pod, or the
shell that runs ``serve run``)::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy:middlewares
"""

from __future__ import annotations

from starlette.middleware import Middleware

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


def middlewares() -> list[Middleware]:
    """The callback Ray Serve's proxy calls (see the module docstring)."""
    return [Middleware(DropClientOverrides)]
