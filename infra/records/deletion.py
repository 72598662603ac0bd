"""Deleting records on request: from the stream and its dead-letter stream, with an audit entry.

A scan decodes every entry (XRANGE in pages) and XDELs those a RecordMatch names. What this
cannot reach is said in docs/data-governance.md ("What the platform stores, for how long, and
how to delete it"): a draft already trained on a record keeps what it learnt, and a dead letter
whose payload does not decode cannot be matched (it is trimmed with the stream's retention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from infra.config import OSDConfig
from infra.records.match import RecordMatch
from infra.records.streams import FIELD, connect, dead_letter_stream, scan_records

DEAD_FIELD = b"orig." + FIELD  # where a dead letter keeps the original payload (streams._dead_letter)


@dataclass
class Deleted:
    stream: int = 0
    dead_letters: int = 0


def matching_ids(client: redis.Redis, key: str, field: bytes, match: RecordMatch) -> list[bytes]:
    """Ids of the entries of `key` whose payload in `field` decodes to a record `match` names."""
    return [eid for eid, rec in scan_records(client, key, field=field) if match.matches_owner(rec)]


def delete_records(client: redis.Redis, stream: str, match: RecordMatch) -> Deleted:
    """XDEL every record `match` names from `stream` and its dead-letter stream. Consumers that
    already read one (pending) see it deleted and ack it (RecordConsumer counts it trimmed)."""
    done = Deleted()
    for key, field, attr in ((stream, FIELD, "stream"), (dead_letter_stream(stream), DEAD_FIELD, "dead_letters")):
        ids = matching_ids(client, key, field, match)
        for i in range(0, len(ids), 1000):
            setattr(done, attr, getattr(done, attr) + client.xdel(key, *ids[i:i + 1000]))
    return done


def delete_from_stream(cfg: OSDConfig, match: RecordMatch) -> Deleted:
    """delete_records on the configured stream, as the admin ACL user where one is set."""
    client = connect(cfg.stream.redis_url, cfg.stream, retries=2, role="admin")
    try:
        return delete_records(client, cfg.stream.stream, match)
    finally:
        client.close()


def audit_deletion(cfg: OSDConfig, match: RecordMatch, deleted: Deleted | None, via: str,
                   **more: Any) -> dict[str, Any]:
    """Write the deletion's entry to the registry's audit log (infra/registry.py, beside the
    rollout decisions); returns it. deleted None: no stream was configured."""
    from infra.registry import Registry

    counts = {"stream": deleted.stream, "dead_letters": deleted.dead_letters} if deleted else None
    entry = {"action": "delete_records", "match": match.as_dict(), "via": via, "deleted": counts, **more}
    Registry.from_config(cfg).audit(entry)
    return entry
