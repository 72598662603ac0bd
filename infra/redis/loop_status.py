"""Live status of the loop's long-running parts (trainer ranks), kept in Redis beside the stream.

Prometheus gets the same numbers as gauges (train/online/metrics.py); this hash is what the ops page
reads, because the page must work with no Prometheus server. One hash per stream, one field
per component, each a small JSON object stamped with the time it was written:

    HSET <stream>:status trainer-0 '{"step": 12, "loss": 1.9, ..., "time": 1763...}'

Beside it, how often each component started (HINCRBY <stream>:starts trainer-0 1): a count
above 1 is a restart, which the ops page shows (a trainer or controller that keeps dying
and coming back looks healthy otherwise), with the time of its latest start
(<stream>:started_at), so the page can say which fault the loop recovered from last.
"""

from __future__ import annotations

import json
import time
from typing import Any


def status_key(stream: str) -> str:
    return f"{stream}:status"


def publish(client: Any, stream: str, component: str, fields: dict[str, Any]) -> None:
    client.hset(status_key(stream), component, json.dumps({**fields, "time": time.time()}, default=str))


def read_all(client: Any, stream: str) -> dict[str, dict[str, Any]]:
    """{component: its last status}; a field that is not JSON is skipped (never fatal to a page)."""
    out = {}
    for name, body in client.hgetall(status_key(stream)).items():
        try:
            out[name.decode() if isinstance(name, bytes) else name] = json.loads(body)
        except ValueError:
            continue
    return out


def starts_key(stream: str) -> str:
    return f"{stream}:starts"


def started_at_key(stream: str) -> str:
    return f"{stream}:started_at"


def count_start(client: Any, stream: str, component: str) -> int:
    """One more start of `component`, stamped with the time; returns its starts so far. One
    round trip, not a transaction: the trainer's ACL user has no MULTI (infra/redis/acl.py)."""
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(starts_key(stream), component, 1)
    pipe.hset(started_at_key(stream), component, repr(time.time()))
    return int(pipe.execute()[0])


def _str(k: Any) -> str:
    return k.decode() if isinstance(k, bytes) else k


def read_starts(client: Any, stream: str) -> dict[str, int]:
    return {_str(k): int(v) for k, v in client.hgetall(starts_key(stream)).items()}


def last_recovery(starts: dict[str, int], client: Any, stream: str) -> dict[str, Any] | None:
    """The latest restart (a start beyond a component's first): {"component", "time"}, or None."""
    stamps = {_str(k): float(v) for k, v in client.hgetall(started_at_key(stream)).items()}
    restarted = [(t, c) for c, t in stamps.items() if starts.get(c, 0) > 1]
    if not restarted:
        return None
    t, c = max(restarted)
    return {"component": c, "time": t}
