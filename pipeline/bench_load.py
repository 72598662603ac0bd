"""`osd bench load`: closed-loop load on a running server at rising concurrency.

For each concurrency level C, C client threads each send chat completions back to back for
a fixed number of seconds. Per level it reports what a capacity plan needs: answered
requests, throughput (requests/s and completion tokens/s), p50/p99 latency of the 2xx
answers, how many were refused for load (429/503, the server's backpressure) and how many
failed otherwise (any other status, transport errors, client timeouts).

Every request has a client timeout and every level a deadline, so a server that hangs
shows up as timeouts in the table instead of a bench that never returns. Standard library +
requests only, with threads: the client must not need the serving stack installed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import requests

CHAT_PATH = "/v1/chat/completions"
HEALTH_PATH = "/healthz"
CONNECT_TIMEOUT_S = 5.0
REJECTED = frozenset({429, 503})
# A refused client waits as Retry-After asks, but at most this long, so a closed loop keeps
# probing the server instead of sleeping through the level.
MAX_BACKOFF_S = 1.0
TIMEOUT = "timeout"
TRANSPORT = "transport"


class LoadBenchError(Exception):
    """The bench cannot run (nothing answers at the URL, bad arguments)."""


@dataclass
class Outcome:
    status: int | str  # HTTP status, or TIMEOUT / TRANSPORT when no answer came
    latency_s: float
    completion_tokens: int = 0
    retry_after_s: float | None = None


def _retry_after(resp: requests.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def send_chat(session: requests.Session, url: str, headers: dict[str, str], body: bytes,
              timeout_s: float) -> Outcome:
    """POST one chat completion; never raises for what the server or network does."""
    t0 = time.perf_counter()
    try:
        resp = session.post(url + CHAT_PATH, data=body, headers=headers, timeout=(CONNECT_TIMEOUT_S, timeout_s))
    except requests.Timeout:
        return Outcome(TIMEOUT, time.perf_counter() - t0)
    except requests.RequestException:
        return Outcome(TRANSPORT, time.perf_counter() - t0)
    latency = time.perf_counter() - t0
    tokens = 0
    if 200 <= resp.status_code < 300:
        try:
            tokens = int(resp.json()["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            return Outcome(TRANSPORT, latency)  # a 2xx without a usable body is not a success
    return Outcome(resp.status_code, latency, tokens, _retry_after(resp))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def summarize(concurrency: int, outcomes: list[Outcome], elapsed_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if isinstance(o.status, int) and 200 <= o.status < 300]
    rejected = sum(1 for o in outcomes if o.status in REJECTED)
    timeouts = sum(1 for o in outcomes if o.status == TIMEOUT)
    latencies = [o.latency_s for o in ok]
    n = len(outcomes)
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    return {
        "concurrency": concurrency,
        "requests": n,
        "ok": len(ok),
        "elapsed_s": elapsed_s,
        "req_per_s": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "completion_tok_per_s": sum(o.completion_tokens for o in ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "p50_ms": None if p50 is None else p50 * 1e3,
        "p99_ms": None if p99 is None else p99 * 1e3,
        "rejected": rejected,
        "rejection_rate": rejected / n if n else 0.0,
        "errors": n - len(ok) - rejected,
        "timeouts": timeouts,
        "statuses": {str(k): v for k, v in sorted(Counter(str(o.status) for o in outcomes).items())},
    }


def _client(url: str, headers: dict[str, str], max_tokens: int, timeout_s: float, deadline: float,
            worker: int, out: list[Outcome]) -> None:
    """One closed-loop client: send, wait for the answer, send again, until the deadline."""
    i = 0
    with requests.Session() as session:
        while time.monotonic() < deadline:
            # Distinct prompts, so nothing upstream can answer from a cache.
            body = json.dumps({"messages": [{"role": "user", "content": f"Client {worker} request {i}: "
                                             "say something short about load testing."}],
                               "max_tokens": max_tokens, "temperature": 0}).encode()
            o = send_chat(session, url, headers, body, timeout_s)
            out.append(o)  # list.append is atomic under the GIL; one list per client anyway
            i += 1
            if o.status in REJECTED:
                pause = MAX_BACKOFF_S if o.retry_after_s is None else min(o.retry_after_s, MAX_BACKOFF_S)
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def run_level(url: str, headers: dict[str, str], concurrency: int, seconds: float, max_tokens: int,
              timeout_s: float) -> dict[str, Any]:
    """C clients for `seconds`; returns the level's summary. Bounded by seconds + timeout."""
    per_client: list[list[Outcome]] = [[] for _ in range(concurrency)]
    t0 = time.monotonic()
    deadline = t0 + seconds
    threads = [threading.Thread(target=_client, args=(url, headers, max_tokens, timeout_s, deadline, w,
                                                      per_client[w]), daemon=True, name=f"load-{w}")
               for w in range(concurrency)]
    for t in threads:
        t.start()
    # The last request starts before the deadline and ends within connect + read timeouts; past
    # that a client is stuck somewhere requests does not time out, and is left behind (daemon).
    join_by = deadline + CONNECT_TIMEOUT_S + timeout_s + 5.0
    for t in threads:
        t.join(max(0.0, join_by - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    outcomes = [o for client in per_client for o in list(client)]
    outcomes += [Outcome(TIMEOUT, time.monotonic() - t0)] * stuck
    return summarize(concurrency, outcomes, time.monotonic() - t0)


def preflight(url: str, headers: dict[str, str]) -> None:
    try:
        requests.get(url + HEALTH_PATH, headers=headers, timeout=(CONNECT_TIMEOUT_S, 30))
    except requests.RequestException as e:
        raise LoadBenchError(f"cannot reach {url}: {type(e).__name__} (is `osd serve` running? "
                             "pass --url)") from None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


HEADER = (f"{'conc':>5}{'requests':>10}{'ok':>7}{'req/s':>9}{'tok/s':>9}{'p50 ms':>10}{'p99 ms':>10}"
          f"{'rejected':>10}{'rej %':>7}{'errors':>8}{'timeouts':>10}")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['concurrency']:>5}{r['requests']:>10}{r['ok']:>7}{r['req_per_s']:>9.2f}"
            f"{r['completion_tok_per_s']:>9.1f}{_fmt(r['p50_ms'], '.0f'):>10}{_fmt(r['p99_ms'], '.0f'):>10}"
            f"{r['rejected']:>10}{r['rejection_rate'] * 100:>7.1f}{r['errors']:>8}{r['timeouts']:>10}")


def run_load_bench(url: str, *, api_key: str | None = None, levels: Sequence[int] = (1, 2, 4, 8, 16, 32),
                   seconds: float = 20.0, max_tokens: int = 16, timeout_s: float = 60.0,
                   json_path: str | Path | None = None) -> dict[str, Any]:
    """Run every level in order; print a table, return (and optionally write) the figures.
    Raises LoadBenchError if nothing answers at `url`."""
    if not levels or min(levels) < 1 or seconds <= 0 or max_tokens < 1 or timeout_s <= 0:
        raise LoadBenchError("levels must be >= 1, and seconds, max_tokens and timeout positive")
    url = url.rstrip("/")
    api_key = api_key if api_key is not None else (os.environ.get("OSD_API_KEY") or None)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    preflight(url, headers)
    with requests.Session() as s:  # warm-up, not counted: the first request pays one-off costs
        send_chat(s, url, headers, json.dumps({"messages": [{"role": "user", "content": "warm up"}],
                                               "max_tokens": max_tokens}).encode(), timeout_s)
    print(f"load bench: {url}{CHAT_PATH}, max_tokens {max_tokens}, {seconds:g} s per level, "
          f"client timeout {timeout_s:g} s", flush=True)
    print(HEADER, flush=True)
    rows = []
    for c in levels:  # a row as each level ends: a long run shows progress
        rows.append(run_level(url, headers, c, seconds, max_tokens, timeout_s))
        print(format_row(rows[-1]), flush=True)
    result = {"url": url, "path": CHAT_PATH, "max_tokens": max_tokens, "seconds_per_level": seconds,
              "timeout_s": timeout_s, "levels": rows}
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result
