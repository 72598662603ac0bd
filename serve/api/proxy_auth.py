"""The API key at Ray Serve's HTTP proxy, in front of every route, Serve's own included.

Serve's proxy answers `/-/routes` itself, before any application sees the request, so the
ingress's own key check cannot cover it. Serve applies the Starlette middlewares returned by
the callable named in RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH around the whole proxy;
`pipeline.stack.launch` points that at `middlewares` below when it starts a local cluster with a key.

Open without the key: `/healthz` and its vLLM alias `/health` (ours) and `/-/healthz`
(Serve's, what KubeRay's probes call); none says more than up or down. The keys are read from
OSD_API_KEY and OSD_SERVE__API_KEYS (serve.api_keys, the tenants' keys, as YAML) in the proxy's
environment; with none set, nothing is checked (local use on loopback). Which tenant a key
names, and whether it is an admin's, is the ingress's business (serve/engine/tenancy.py).

The ops page (serve/api/ops/auth.py): its login form is open, and /ops paths also take the
session cookie that the form sets, so a browser can use the page without the header.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, Mapping

import yaml

from serve.api.ops import auth as ops_auth

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "serve.api.proxy_auth:middlewares"
KEYS_ENV = "OSD_SERVE__API_KEYS"
OPEN_PATHS = frozenset({"/healthz", "/health", "/-/healthz"})

_UNAUTHORIZED = json.dumps({"error": {
    "message": "missing or wrong API key (send Authorization: Bearer <key>)",
    "type": "authentication_error", "param": None, "code": "invalid_api_key"}}).encode()


class APIKeyMiddleware:
    """Pure ASGI: refuse any HTTP request but OPEN_PATHS without `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, api_key: str | None = None, tenant_keys: list[tuple[str, bool]] | None = None):
        self.app = app
        key = api_key if api_key is not None else os.environ.get("OSD_API_KEY", "")
        entries = tenant_keys if tenant_keys is not None else tenant_keys_from(os.environ)
        # The ops page's session key, as the ingress picks it (serve/engine/tenancy.py KeyRing.ops_key).
        self.key = key or next((k for k, admin in entries if admin), "")
        self.expected = [f"Bearer {k}".encode() for k in [key, *(k for k, _ in entries)] if k] or None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        # /ops itself passes too: without a session the ingress answers it with the login form's redirect.
        if scope["type"] != "http" or self.expected is None or path in OPEN_PATHS or path in ops_auth.BROWSER_ENTRY:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        got = headers.get(b"authorization", b"")
        # Every key compared, each in constant time: the time taken does not say which matched.
        if sum(hmac.compare_digest(got, e) for e in self.expected) or (self.key and ops_auth.session_ok(
                self.key, path, headers.get(b"cookie", b""))):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode())]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def tenant_keys_from(environ: Mapping[str, str]) -> list[tuple[str, bool]]:
    """(key, admin) of each serve.api_keys entry as OSD_SERVE__API_KEYS carries them (a YAML
    list of {key, tenant, admin}); the config model validates the rest where the ingress loads it."""
    entries = yaml.safe_load(environ.get(KEYS_ENV) or "[]") or []
    return [(str(e["key"]), bool(e.get("admin"))) for e in entries if isinstance(e, dict) and e.get("key")]


def middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(APIKeyMiddleware)]
