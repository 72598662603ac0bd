"""Who a request is for, and what the platform may keep of it.

Pure (no Ray, no FastAPI): the ingress asks `KeyRing.caller` who sent a request, and
`record_decision` whether its record is written; `suffix_pool` names the suffix index its
output joins and drafts from (docs/data-governance.md, "What the platform stores, for how
long, and how to delete it").
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

from infra.config import DEFAULT_TENANT, ServeConfig


@dataclass(frozen=True)
class Origin:
    """Who a request is for: the tenant of its API key, the OpenAI `user` it named and its id.
    `pool` is the suffix index its output joins and it drafts from (suffix_pool; None: the
    shared one). The suffix index keeps it so deletion can find the request's output there."""

    tenant: str | None = None
    user: str | None = None
    request_id: str | None = None
    pool: str | None = None


def origin_of(serve_cfg: ServeConfig, tenant: str | None, user: str | None, request_id: str | None) -> Origin:
    """A request's (or a record's) Origin; a record from before tenants is tenant `default`."""
    tenant = tenant or DEFAULT_TENANT
    return Origin(tenant, user, request_id, suffix_pool(serve_cfg, tenant))


@dataclass(frozen=True)
class Caller:
    tenant: str
    admin: bool


class KeyRing:
    """serve.api_keys, plus OSD_API_KEY as tenant `default` with admin rights (the operator's
    key, what a single-key deployment always had). No key at all: every request is tenant
    `default`, admin (local use on loopback)."""

    def __init__(self, serve_cfg: ServeConfig, legacy_key: str | None):
        self.entries = [(f"Bearer {k.key}".encode(), Caller(k.tenant, k.admin)) for k in serve_cfg.api_keys]
        if legacy_key:
            self.entries.append((f"Bearer {legacy_key}".encode(), Caller(DEFAULT_TENANT, True)))
        self.ops_key = self._ops_key(legacy_key, serve_cfg)

    @property
    def open(self) -> bool:
        return not self.entries

    def _ops_key(self, legacy_key: str | None, serve_cfg: ServeConfig) -> str | None:
        """The key the ops page signs its sessions with: OSD_API_KEY, else the first admin key;
        None (an open page) only where no key is set at all. Tenant keys with no admin key
        lock it with a key nobody has."""
        if self.open:
            return None
        admin = next((k.key for k in serve_cfg.api_keys if k.admin), None)
        return legacy_key or admin or secrets.token_urlsafe(32)

    def caller(self, authorization: str) -> Caller | None:
        """The caller an Authorization header names; None for a missing or unknown key. Every
        entry is compared (constant time each), so the time taken does not say which matched."""
        if self.open:
            return Caller(DEFAULT_TENANT, True)
        got = authorization.encode()
        found = None
        for expected, caller in self.entries:
            if hmac.compare_digest(got, expected):
                found = caller
        return found


def record_decision(policy: str, choice: bool | None) -> bool:
    """Whether a request's record is written, from its tenant's policy and the client's
    choice (serve/api/openai_protocol.py record_choice: False opted out, True opted in, None silent)."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default-off":
        return choice is True
    return choice is not False  # default-on


SHARED_POOL = None  # the suffix index of single-tenant serving and of tenants with share_suffix


def suffix_pool(serve_cfg: ServeConfig, tenant: str | None) -> str | None:
    """The suffix index a tenant's requests draft from and whose outputs join it: one per tenant
    once keys name tenants, the shared one where the tenant sets share_suffix (or where no
    keys are configured: one tenant, one index, as before tenants existed)."""
    tenant = tenant or DEFAULT_TENANT
    if not serve_cfg.api_keys or serve_cfg.tenant(tenant).share_suffix:
        return SHARED_POOL
    return tenant
