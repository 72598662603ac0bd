"""The API key at Ray Serve's HTTP proxy, in front of every route, Serve's own included.

Serve's proxy answers `/-/routes` itself, before any application sees the request, so the
ingress's own key check cannot cover it. Serve applies the Starlette middlewares returned by
the callable named in RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH around the whole proxy;
`pipeline.launch` points that at `middlewares` below when it starts a local cluster with a key.

Open without the key: `/healthz` (ours) and `/-/healthz` (Serve's, what KubeRay's probes
call); neither says more than up or down. The key is read from OSD_API_KEY in the proxy's
environment; with none set, nothing is checked (local use on loopback).
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "serve.proxy_auth:middlewares"
OPEN_PATHS = frozenset({"/healthz", "/-/healthz"})

_UNAUTHORIZED = json.dumps({"error": {
    "message": "missing or wrong API key (send Authorization: Bearer <key>)",
    "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()


class APIKeyMiddleware:
    """Pure ASGI: refuse any HTTP request but OPEN_PATHS without `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, api_key: str | None = None):
        self.app = app
        key = api_key if api_key is not None else os.environ.get("OSD_API_KEY", "")
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.expected is None or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(APIKeyMiddleware)]
