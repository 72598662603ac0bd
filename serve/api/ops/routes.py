"""The ops routes' handlers, for the ingress (serve/api/app.py) to mount:

    GET  /ops               the page (a browser without a session is sent to the login form)
    GET  /ops/fragment      its main section, for the page's auto-refresh
    GET  /ops/api/summary   the summary document (serve/api/ops/source.py), JSON
    GET  /ops/login, POST /ops/login, POST /ops/logout

With an API key, each needs `Authorization: Bearer <key>` or the session cookie
(serve/api/ops/auth.py). The summary's Redis and registry reads run off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import urllib.parse
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from infra.config import OSDConfig
from serve.api.ops import auth as ops_auth, page as ops_page

MAX_LOGIN_BODY = 4096
log = logging.getLogger("ray.serve")
_NO_STORE = {"Cache-Control": "no-store"}


class OpsRoutes:
    def __init__(self, cfg: OSDConfig, api_key: str | None,
                 replica_stats: Callable[[], Awaitable[list[dict[str, Any]]]]):
        self.cfg, self.api_key = cfg, api_key
        self.replica_stats = replica_stats  # each replica's stats(recent=True)
        self._source: Any = None

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        header = request.headers.get("authorization", "")
        if hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
            return True
        return ops_auth.session_ok(self.api_key, request.url.path, request.headers.get("cookie", ""))

    async def summary(self) -> dict[str, Any]:
        from serve.api.ops.source import OpsSource

        if self._source is None:  # built on first use: a page never opened costs no Redis client
            self._source = await asyncio.to_thread(OpsSource, self.cfg)
        replicas = await self.replica_stats()
        return await asyncio.to_thread(self._source.summary, replicas)

    async def _answer(self, render: Callable[[dict[str, Any]], Response]) -> Response:
        """render(summary); a failure to build it (registry unreadable, a replica gone) is logged
        and answered 500 in the OpenAI error form, like every other route's."""
        try:
            return render(await self.summary())
        except Exception:
            log.exception("the ops summary failed")
            return JSONResponse({"error": {"message": "the ops summary failed; see the ingress log",
                                           "type": "server_error", "param": None, "code": "internal_error"}},
                                status_code=500)

    async def page(self, request: Request) -> Response:
        if not self._authorized(request):
            return RedirectResponse(ops_auth.LOGIN_PATH, status_code=303, headers=_NO_STORE)
        return await self._answer(lambda s: HTMLResponse(ops_page.page(s), headers=_NO_STORE))

    async def fragment(self, request: Request) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        return await self._answer(lambda s: HTMLResponse(ops_page.main(s), headers=_NO_STORE))

    async def api_summary(self, request: Request) -> Response:
        if not self._authorized(request):
            return _unauthorized()
        return await self._answer(lambda s: JSONResponse(s, headers=_NO_STORE))

    async def login_form(self, request: Request) -> Response:
        if self.api_key is None or self._authorized(request):
            return RedirectResponse("/ops", status_code=303)
        return HTMLResponse(ops_page.login_page(), headers=_NO_STORE)

    async def login(self, request: Request) -> Response:
        if self.api_key is None:
            return RedirectResponse("/ops", status_code=303)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_LOGIN_BODY:
                return HTMLResponse(ops_page.login_page("request too large"), status_code=413)
        key = urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
        if not hmac.compare_digest(key.encode(), self.api_key.encode()):
            return HTMLResponse(ops_page.login_page("wrong key"), status_code=401, headers=_NO_STORE)
        secure = request.headers.get("x-forwarded-proto", request.url.scheme) == "https"
        resp = RedirectResponse("/ops", status_code=303, headers=_NO_STORE)
        resp.headers.append("set-cookie", ops_auth.set_cookie(ops_auth.session_token(self.api_key), secure))
        return resp

    async def logout(self, request: Request) -> Response:
        resp = RedirectResponse(ops_auth.LOGIN_PATH, status_code=303)
        resp.headers.append("set-cookie", ops_auth.clear_cookie())
        return resp


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "missing or wrong API key (sign in at /ops/login, or send "
                                              "Authorization: Bearer <key>)", "type": "authentication_error",
                                   "param": None, "code": "invalid_api_key"}}, status_code=401)
