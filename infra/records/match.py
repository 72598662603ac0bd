"""Which records a deletion names: by tenant, by the OpenAI `user`, or by request id.

Pure, so the stream's deletion (infra/records/deletion.py) and the suffix indexes' (serve/)
match by the same rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from infra.config import DEFAULT_TENANT


@dataclass(frozen=True)
class RecordMatch:
    """Every given field must equal the record's; at least one must be given. A record from
    before tenants (schema v1, v2) counts as tenant `default`."""

    tenant: str | None = None
    user: str | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        if not any(v for v in asdict(self).values()):
            raise ValueError("name what to delete: a tenant, a user or a request id")

    def matches(self, tenant: str | None, user: str | None, request_id: str | None) -> bool:
        return ((self.tenant is None or self.tenant == (tenant or DEFAULT_TENANT))
                and (self.user is None or self.user == user)
                and (self.request_id is None or self.request_id == request_id))

    def matches_owner(self, owner: object) -> bool:
        """For anything with tenant, user and request_id attributes (a Record, an Origin)."""
        return self.matches(getattr(owner, "tenant", None), getattr(owner, "user", None),
                            getattr(owner, "request_id", None))

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v}
