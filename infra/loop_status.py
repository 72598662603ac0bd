"""Live status of the loop's long-running parts (trainer ranks), kept in Redis beside the stream.

Prometheus gets the same numbers as gauges (train/metrics.py); this hash is what the ops page
reads, because the page must work with no Prometheus server. One hash per stream, one field
per component, each a small JSON object stamped with the time it was written:

    HSET <stream>:status trainer-0 '{"step": 12, "loss": 1.9, ..., "time": 1763...}'
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
