"""Browser access to the ops page when OSD_API_KEY is set: a login form trades the key for an
HttpOnly session cookie, so the key is typed once and never appears in a URL or in script.

The cookie holds `<expiry>.<HMAC-SHA256(key, expiry)>`: the server keeps no sessions, both the
ingress and Serve's proxy (serve/api/proxy_auth.py) check it from the key alone, and changing the
key ends every session. It is scoped to /ops (SameSite=Strict, Path=/ops), and only /ops paths
accept it: the OpenAI routes still need the Authorization header.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from http.cookies import CookieError, SimpleCookie

COOKIE = "osd_ops_session"
TTL_S = 12 * 3600
LOGIN_PATH = "/ops/login"
# What a browser without a session may reach: the page (which redirects to the form) and the form.
BROWSER_ENTRY = frozenset({"/ops", LOGIN_PATH})


def is_ops_path(path: str) -> bool:
    return path == "/ops" or path.startswith("/ops/")


def _mac(key: str, expiry: int) -> str:
    return hmac.new(key.encode(), f"osd-ops-session:{expiry}".encode(), hashlib.sha256).hexdigest()


def session_token(key: str, now: float | None = None) -> str:
    expiry = int((time.time() if now is None else now) + TTL_S)
    return f"{expiry}.{_mac(key, expiry)}"


def valid_token(key: str, token: str, now: float | None = None) -> bool:
    expiry_s, _, mac = token.partition(".")
    if not expiry_s.isdigit() or int(expiry_s) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(key, int(expiry_s)).encode())


def cookie_token(cookie_header: str | bytes) -> str | None:
    if isinstance(cookie_header, bytes):
        cookie_header = cookie_header.decode("latin-1")
    try:
        jar = SimpleCookie(cookie_header)
    except CookieError:
        return None
    return jar[COOKIE].value if COOKIE in jar else None


def session_ok(key: str, path: str, cookie_header: str | bytes) -> bool:
    """A valid session cookie on an /ops path."""
    token = cookie_token(cookie_header) if is_ops_path(path) and cookie_header else None
    return token is not None and valid_token(key, token)


def set_cookie(token: str, secure: bool) -> str:
    return (f"{COOKIE}={token}; Path=/ops; Max-Age={TTL_S}; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure else ""))


def clear_cookie() -> str:
    return f"{COOKIE}=; Path=/ops; Max-Age=0; HttpOnly; SameSite=Strict"
