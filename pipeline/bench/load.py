"""`osd bench load`: closed-loop streaming load on a running server at rising concurrency.

For each concurrency level C, C client threads each stream chat completions back to back for
a fixed number of seconds, or (`--requests N`) each through its own fixed list of N prompts,
so that the modes compared serve exactly the same requests (with a fixed time, the faster
mode walks further down the list, into prompts the slower one never sends); with
`--speculation both` (the default) each level runs twice, speculation on and off (the
request's `osd_speculate`), one after the other, so the two are compared at the same load
in one run.

Prompts are first-time prompts while the list lasts. The server's suffix pool learns every
answer it serves, so a prompt sent again is answered from memory, a different workload. So
each level takes prompts no earlier level took, both modes of a level send the same ones
from the same place in the list, and speculation on goes first (run second, it would find the
other mode's answers to its very prompts; plain decoding drafts nothing, so it cannot). With
a fixed time the faster mode walks further down the list, and the next level starts past the
furthest prompt either took. Until 2026-12-07 a timed level's second mode took the prompts
after the first one's: at 16 clients on an AMX Xeon, with speculation off in both modes
(`serve.k` 0), the first mode's prompts read 0.82x and 0.85x the second's tok/s, so the
on/off ratios of timed runs compared prompt sets, not modes. Repeats are counted and reported.

Per level it reports what a capacity plan needs: answered requests, output tokens/s, time
to first token and inter-token latency (p50/p99; ITL is the gap between streamed chunks, one
per step), end-to-end latency, tokens per target forward (from the server's /osd/stats: output tokens over target forwards, which
continuous batching and speculation both raise), how many were refused for load (429/503)
and how many failed otherwise. It writes JSON and a PNG chart (throughput and p99 ITL
against concurrency, speculation on and off).

`--workload multiturn` makes each request a conversation: a held-out ShareGPT conversation's
first user turn, then its second with the server's own answer before it, as a chat client
sends it; the time to first token is also reported per turn. Each speculation mode sends its
own `cache_salt`, so neither finds the other's prompts in the server's prefix cache.

Every request has a client timeout and every level a deadline, so a server that hangs
shows up as timeouts in the table instead of a bench that never returns. The client speaks
plain HTTP with httpx and threads; it needs only the prompts it sends from this project.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
from tabulate import tabulate

from infra.common.stats import percentile  # noqa: F401 (re-exported)

CHAT_PATH = "/v1/chat/completions"
HEALTH_PATH = "/healthz"
STATS_PATH = "/osd/stats"
CONNECT_TIMEOUT_S = 5.0
REJECTED = frozenset({429, 503})
# A refused client waits as Retry-After asks, but at most this long, so a closed loop keeps
# probing the server instead of sleeping through the level.
MAX_BACKOFF_S = 1.0
TIMEOUT = "timeout"
TRANSPORT = "transport"
MODES = {"both": (True, False), "on": (True,), "off": (False,)}


class LoadBenchError(Exception):
    """The bench cannot run (nothing answers at the URL, bad arguments)."""


@dataclass
class Outcome:
    status: int | str  # HTTP status, or TIMEOUT / TRANSPORT when no answer came
    latency_s: float
    completion_tokens: int = 0
    retry_after_s: float | None = None
    ttft_s: float | None = None
    # Gaps between streamed chunks: one per step (a speculative step's tokens share a chunk),
    # so a stall (a prefill in the way) shows whole, as vLLM's benchmark counts it.
    itl_s: list[float] = field(default_factory=list)
    chunk_at: list[float] = field(default_factory=list)  # perf_counter of each chunk after the first
    text: str = ""  # the answer (a conversation's next turn sends it back)
    turn: int = 0  # a conversation's turn (0: the first, or a single prompt)


FIXED_PROMPT = "Say something short about load testing."  # `--prompts fixed`
Turns = "str | tuple[str, ...]"  # a request: a prompt, or a conversation's user turns
SALT = {True: "osd-bench-speculation-on", False: "osd-bench-speculation-off"}  # each mode's cache_salt

def _timeout(read_s: float) -> httpx.Timeout:
    """Connect within CONNECT_TIMEOUT_S; then each read (a streamed chunk) within read_s."""
    return httpx.Timeout(read_s, connect=CONNECT_TIMEOUT_S)


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def send_chat(session: httpx.Client, url: str, headers: dict[str, str], body: bytes,
              timeout_s: float) -> Outcome:
    """Stream one chat completion (SSE); never raises for what the server or network does.
    Chunk arrival times give TTFT and the inter-token gaps; the final usage chunk the count."""
    t0 = time.perf_counter()
    try:
        with session.stream("POST", url + CHAT_PATH, content=body, headers=headers,
                            timeout=_timeout(timeout_s)) as resp:
            if not 200 <= resp.status_code < 300:
                resp.read()  # drain, so the connection is reusable
                return Outcome(resp.status_code, time.perf_counter() - t0, retry_after_s=_retry_after(resp))
            return _read_stream(resp, t0)
    except httpx.TimeoutException:
        return Outcome(TIMEOUT, time.perf_counter() - t0)
    except (httpx.HTTPError, httpx.StreamError, ValueError, KeyError, TypeError):
        return Outcome(TRANSPORT, time.perf_counter() - t0)


def _read_stream(resp: httpx.Response, t0: float) -> Outcome:
    ttft = last = None
    itl: list[float] = []
    at: list[float] = []
    parts: list[str] = []
    tokens = 0
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            return Outcome(TRANSPORT, time.perf_counter() - t0)
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
        content = [(c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []]
        if not any(content):
            continue
        parts += content
        now = time.perf_counter()
        if ttft is None:
            ttft = now - t0
        else:
            itl.append(now - last)
            at.append(now)
        last = now
    if ttft is None and tokens:
        return Outcome(TRANSPORT, time.perf_counter() - t0)  # tokens counted but never streamed
    return Outcome(resp.status_code, time.perf_counter() - t0, tokens, None, ttft, itl, at, "".join(parts))


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def summarize(concurrency: int, outcomes: list[Outcome], elapsed_s: float, speculate: bool = True,
              forwards: int | None = None) -> dict[str, Any]:
    ok = [o for o in outcomes if isinstance(o.status, int) and 200 <= o.status < 300]
    rejected = sum(1 for o in outcomes if o.status in REJECTED)
    timeouts = sum(1 for o in outcomes if o.status == TIMEOUT)
    latencies = [o.latency_s for o in ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    itls = [g for o in ok for g in o.itl_s]
    tokens = sum(o.completion_tokens for o in ok)
    n = len(outcomes)
    return {
        "concurrency": concurrency,
        "speculation": speculate,
        "requests": n,
        "ok": len(ok),
        "elapsed_s": elapsed_s,
        "req_per_s": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "completion_tok_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "p50_ms": _ms(percentile(latencies, 50)),
        "p99_ms": _ms(percentile(latencies, 99)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        # A conversation's turns apart (one entry per turn; a single-prompt level has one).
        "ttft_p50_ms_by_turn": [_ms(percentile([o.ttft_s for o in ok if o.turn == t and o.ttft_s is not None], 50))
                                for t in range(max((o.turn for o in ok), default=0) + 1)],
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        # Output tokens per target forward in the level (None: the server did not say).
        "tokens_per_forward": tokens / forwards if forwards else None,
        "rejected": rejected,
        "rejection_rate": rejected / n if n else 0.0,
        "errors": n - len(ok) - rejected,
        "timeouts": timeouts,
        "statuses": {str(k): v for k, v in sorted(Counter(str(o.status) for o in outcomes).items())},
    }


class PromptCursor:
    """A timed level's prompts in one mode (module doc): each request takes the next one across
    the level's clients, from `start`; past the list's end they wrap, and each wrapped one is a
    repeat of an earlier level's."""

    def __init__(self, n: int, start: int = 0):
        self.n, self.start, self.taken = n, start, 0
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self.taken += 1
            return (self.start + self.taken - 1) % self.n

    @property
    def end(self) -> int:
        """One past the furthest place in the list taken (unwrapped)."""
        return self.start + self.taken

    @property
    def repeats(self) -> int:
        return max(0, self.end - max(self.start, self.n))


def _client(url: str, headers: dict[str, str], prompts: Sequence[Turns], max_tokens: int, speculate: bool,
            timeout_s: float, deadline: float, worker: int, out: list[Outcome], count: int | None = None,
            start: int = 0, cursor: PromptCursor | None = None) -> None:
    """One closed-loop client: send, read the stream to its end, send again, until the deadline
    (the next prompt from `cursor`, which run_level shares among its clients), or, given a
    count, until it has sent that many (prompts start + worker * count onwards)."""
    i = 0
    with httpx.Client() as session:
        while time.monotonic() < deadline if count is None else i < count:
            at = cursor.take() if count is None else start + worker * count + i
            o = _converse(session, url, headers, prompts[at % len(prompts)], max_tokens, speculate, timeout_s, out)
            i += 1
            if o.status in REJECTED:
                pause = MAX_BACKOFF_S if o.retry_after_s is None else min(o.retry_after_s, MAX_BACKOFF_S)
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def _converse(session: httpx.Client, url: str, headers: dict[str, str], item: Turns,
              max_tokens: int, speculate: bool, timeout_s: float, out: list[Outcome]) -> Outcome:
    """One prompt, or a conversation: each user turn sent with the server's answers to the
    turns before, as a chat client does. Appends each turn's outcome to `out`; returns the last."""
    messages: list[dict[str, str]] = []
    for turn, text in enumerate((item,) if isinstance(item, str) else item):
        messages.append({"role": "user", "content": text})
        # The same prompts go out in both modes: a salt per mode keeps the second mode from
        # finding the first one's prompts in the server's prefix cache (vLLM's field).
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, "osd_speculate": speculate,
                           "cache_salt": SALT[speculate]}).encode()
        o = send_chat(session, url, headers, body, timeout_s)
        o.turn = turn
        out.append(o)  # list.append is atomic under the GIL; one list per client anyway
        if o.status != 200:
            break
        messages.append({"role": "assistant", "content": o.text})
    return o


def server_forwards(url: str, headers: dict[str, str]) -> int | None:
    """Target forwards the server has run so far (its /osd/stats), None if it does not say."""
    try:
        r = httpx.get(url + STATS_PATH, headers=headers, timeout=_timeout(30))
        return int(r.json()["target_forwards"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def run_level(url: str, headers: dict[str, str], concurrency: int, seconds: float, max_tokens: int,
              timeout_s: float, prompts: Sequence[Turns] = (FIXED_PROMPT,),
              speculate: bool = True, requests: int | None = None, start: int = 0,
              cursor: PromptCursor | None = None) -> dict[str, Any]:
    """C clients for `seconds` (prompts from `cursor`, a new one of its own if None), or each
    for `requests` requests (prompts start onwards); returns the level's summary. Bounded by
    seconds (or the requests' timeouts) + a timeout."""
    cursor = cursor or PromptCursor(len(prompts))
    per_client: list[list[Outcome]] = [[] for _ in range(concurrency)]
    before = server_forwards(url, headers)
    t0 = time.monotonic()
    per_request_s = CONNECT_TIMEOUT_S + timeout_s + 5.0
    deadline = t0 + (seconds if requests is None else requests * per_request_s)
    threads = [threading.Thread(target=_client, args=(url, headers, prompts, max_tokens, speculate, timeout_s,
                                                      deadline, w, per_client[w], requests, start, cursor),
                                daemon=True, name=f"load-{w}")
               for w in range(concurrency)]
    for t in threads:
        t.start()
    # The last request starts before the deadline and ends within connect + read timeouts; past
    # that a client is stuck somewhere httpx does not time out, and is left behind (daemon).
    join_by = deadline + per_request_s
    for t in threads:
        t.join(max(0.0, join_by - time.monotonic()))
    elapsed = time.monotonic() - t0
    after = server_forwards(url, headers)
    stuck = sum(t.is_alive() for t in threads)
    outcomes = [o for client in per_client for o in list(client)]
    outcomes += [Outcome(TIMEOUT, elapsed)] * stuck
    forwards = after - before if before is not None and after is not None else None
    return summarize(concurrency, outcomes, elapsed, speculate, forwards)


def _order(modes: tuple[bool, ...]) -> tuple[bool, ...]:
    """The modes of a level in the order they run: speculation on first, since both send the
    same prompts (module doc)."""
    return tuple(sorted(modes, reverse=True))


def preflight(url: str, headers: dict[str, str]) -> None:
    try:
        httpx.get(url + HEALTH_PATH, headers=headers, timeout=_timeout(30))
    except httpx.HTTPError as e:
        raise LoadBenchError(f"cannot reach {url}: {type(e).__name__} (is `osd serve` running? "
                             "pass --url)") from None


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


HEADER = ("conc", "spec", "ok", "tok/s", "ttft50", "ttft99", "itl50", "itl99", "p50 ms", "p99 ms", "tok/fwd",
          "rej", "err", "t/o")


def format_row(r: dict[str, Any]) -> list[str]:
    return [str(r["concurrency"]), "on" if r["speculation"] else "off", str(r["ok"]),
            f"{r['completion_tok_per_s']:.1f}", _fmt(r["ttft_p50_ms"], ".0f"), _fmt(r["ttft_p99_ms"], ".0f"),
            _fmt(r["itl_p50_ms"], ".0f"), _fmt(r["itl_p99_ms"], ".0f"), _fmt(r["p50_ms"], ".0f"),
            _fmt(r["p99_ms"], ".0f"), _fmt(r["tokens_per_forward"], ".2f"), str(r["rejected"]), str(r["errors"]),
            str(r["timeouts"])]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The levels as a table, a row per level and mode, numbers right-aligned."""
    return tabulate([format_row(r) for r in rows], headers=HEADER, disable_numparse=True,
                    colalign=("right",) * len(HEADER))


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the batching goals are stated in, from one run: throughput at C clients over
    1 client, speculation on over off at each C, p99 ITL at C over p50 ITL at 1 client."""
    by = {(r["concurrency"], r["speculation"]): r for r in rows}
    out: dict[str, Any] = {"throughput_vs_1": {}, "spec_on_vs_off": {}, "itl_p99_vs_p50_at_1": {}}
    for (c, spec), r in sorted(by.items()):
        base = by.get((1, spec))
        key = f"{c}/{'on' if spec else 'off'}"
        if base and base["completion_tok_per_s"]:
            out["throughput_vs_1"][key] = r["completion_tok_per_s"] / base["completion_tok_per_s"]
        if base and base["itl_p50_ms"] and r["itl_p99_ms"] is not None:
            out["itl_p99_vs_p50_at_1"][key] = r["itl_p99_ms"] / base["itl_p50_ms"]
        off = by.get((c, False))
        if spec and off and off["completion_tok_per_s"]:
            out["spec_on_vs_off"][str(c)] = r["completion_tok_per_s"] / off["completion_tok_per_s"]
    return out


def write_chart(result: dict[str, Any], path: str | Path) -> None:
    """Output tokens/s and p99 inter-token latency against concurrency, speculation on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for spec, style in ((True, "o-"), (False, "s--")):
        rows = sorted((r for r in result["levels"] if r["speculation"] is spec), key=lambda r: r["concurrency"])
        if not rows:
            continue
        label = f"speculation {'on' if spec else 'off'}"
        ax1.plot([r["concurrency"] for r in rows], [r["completion_tok_per_s"] for r in rows], style, label=label)
        ax2.plot([r["concurrency"] for r in rows], [r["itl_p99_ms"] for r in rows], style, label=label)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"osd bench load: {result['url']}, max_tokens {result['max_tokens']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def long_prompt_probe(url: str, headers: dict[str, str], *, streams: int = 7, prompt_words: int = 1900,
                      max_tokens: int = 128, timeout_s: float = 120.0,
                      prompts: Sequence[str] = ("Tell me a long story.",)) -> dict[str, Any]:
    """`streams` clients stream replies; then one request with a prompt of `prompt_words`
    words (about as many tokens) arrives. Reported: the streams' median gap between chunks
    before it, their largest gap while it prefills (until its first token), and the ratio:
    how many decode steps a long prompt costs the running streams."""
    stop = threading.Event()
    per_client: list[list[Outcome]] = [[] for _ in range(streams)]

    def client(w: int) -> None:
        with httpx.Client() as session:
            while not stop.is_set():
                body = json.dumps({"messages": [{"role": "user", "content": prompts[w % len(prompts)]}],
                                   "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
                per_client[w].append(send_chat(session, url, headers, body, timeout_s))

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(streams)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    sent = time.perf_counter()
    with httpx.Client() as session:
        body = json.dumps({"messages": [{"role": "user", "content": "word " * prompt_words}], "max_tokens": 8,
                           "temperature": 0, "stream": True}).encode()
        long = send_chat(session, url, headers, body, timeout_s)
    first = sent + (long.ttft_s or long.latency_s)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout_s)
    gaps = [(at, g) for c in per_client for o in c for at, g in zip(o.chunk_at, o.itl_s)]
    before = [g for at, g in gaps if sent - 3.0 <= at < sent]
    during = [g for at, g in gaps if sent < at <= first]
    base = percentile(before, 50)
    worst = max(during) if during else None
    return {"streams": streams, "prompt_words": prompt_words, "long_status": long.status,
            "stream_statuses": dict(Counter(str(o.status) for c in per_client for o in c)),
            "long_ttft_ms": _ms(long.ttft_s), "gap_before_p50_ms": _ms(base), "gap_during_max_ms": _ms(worst),
            "gap_during_p50_ms": _ms(percentile(during, 50)),
            "max_gap_in_decode_steps": worst / base if base and worst is not None else None}


def load_prompts(source: str, limit: int = 512) -> list[str]:
    """`sharegpt`: first user turns of held-out ShareGPT conversations (the data the head is
    warm-started on is kept out); else a JSONL file of {"prompt": ...} lines."""
    from infra import prompts as pr

    try:
        got = pr.load_sharegpt(split="held_out") if source == "sharegpt" else pr.load_jsonl(source)
    except (OSError, ValueError) as e:
        raise LoadBenchError(f"cannot read prompts from {source}: {e}") from None
    texts = [p.text for p in got if p.text.strip()][:limit]
    if not texts:
        raise LoadBenchError(f"no prompts in {source}")
    return texts


def load_conversations(cfg: Any, limit: int = 512) -> list[tuple[str, ...]]:
    """The first two user turns of held-out ShareGPT conversations that have two, each within
    the data section's length filter."""
    from infra.prompts import PromptDataError
    from pipeline.bench.engine import conversation_turns

    try:
        got = conversation_turns(cfg, limit, cfg.data.max_prompt_chars)
    except PromptDataError as e:
        raise LoadBenchError(f"cannot read ShareGPT conversations: {e}") from None
    if not got:
        raise LoadBenchError("no held-out ShareGPT conversation has two user turns")
    return got


def first_turns(prompts: Sequence[Turns]) -> list[str]:
    """Each request's first user turn (a prompt is its own)."""
    return [p if isinstance(p, str) else p[0] for p in prompts]


WARM_PROMPT = "Warm-up: answer with one word."  # never one of the levels' prompts, FIXED_PROMPT included
WARM_TRIES = 32  # the longest prompts tried, longest first, for one the server accepts


def warm_up(url: str, headers: dict[str, str], prompts: Sequence[Turns], max_tokens: int,
            timeout_s: float, modes: Sequence[bool]) -> None:
    """Untimed: one request in each mode (one-off costs, such as the cost rule's profile at the
    first speculative request), on a prompt the levels never send; then, without speculation,
    the longest prompt the server accepts (longer ones exceed its context and are refused at
    once), so its KV pool has grown to the longest context the levels reach before any level
    is timed (a growth allocates the whole pool again: about a second, on a fresh server,
    charged to whichever mode met it first). Requests without speculation teach the server's
    drafts nothing (the suffix index learns only from requests it drafted for), so the
    levels' prompts stay first-time for them."""
    def send(session: httpx.Client, text: str, spec: bool) -> Outcome:
        return send_chat(session, url, headers, json.dumps({
            "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True,
            "osd_speculate": spec}).encode(), timeout_s)

    with httpx.Client() as s:
        for spec in modes:
            send(s, WARM_PROMPT, spec)
        for text in sorted(first_turns(prompts), key=len, reverse=True)[:WARM_TRIES]:
            if send(s, text, False).status == 200:
                break


def run_load_bench(url: str, *, api_key: str | None = None, levels: Sequence[int] = (1, 2, 4, 8, 16),
                   seconds: float = 20.0, max_tokens: int = 64, timeout_s: float = 60.0,
                   speculation: str = "both", prompts: Sequence[Turns] | None = None,
                   json_path: str | Path | None = None, png_path: str | Path | None = None,
                   long_prompt: bool = False, requests: int | None = None) -> dict[str, Any]:
    """Run every level (with speculation on, off or both, interleaved per level) in order,
    then with `long_prompt` the long-prompt probe; print a table, return (and optionally
    write as JSON and a PNG) the figures. Raises LoadBenchError if nothing answers at `url`."""
    if not levels or min(levels) < 1 or seconds <= 0 or max_tokens < 1 or timeout_s <= 0:
        raise LoadBenchError("levels must be >= 1, and seconds, max_tokens and timeout positive")
    if requests is not None and requests < 1:
        raise LoadBenchError(f"requests per client must be >= 1, got {requests}")
    if speculation not in MODES:
        raise LoadBenchError(f"speculation must be one of {', '.join(MODES)}, got {speculation!r}")
    prompts = list(prompts or [FIXED_PROMPT])
    url = url.rstrip("/")
    api_key = api_key if api_key is not None else (os.environ.get("OSD_API_KEY") or None)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    preflight(url, headers)
    warm_up(url, headers, prompts, max_tokens, timeout_s, MODES[speculation])
    per_level = f"{seconds:g} s per level" if requests is None else f"{requests} requests per client and level"
    print(f"load bench: {url}{CHAT_PATH}, streaming, max_tokens {max_tokens}, {len(prompts)} prompts, "
          f"{per_level}, speculation {speculation}, client timeout {timeout_s:g} s", flush=True)
    rows, start, cursors = [], 0, []
    if requests is not None and sum(levels) * requests > len(prompts):
        print(f"note: {sum(levels) * requests} requests a mode over {len(prompts)} prompts: some repeat", flush=True)
    for c in levels:  # a line as each level ends: a long run shows progress
        level = [PromptCursor(len(prompts), start) for _ in MODES[speculation]] if requests is None else []
        for j, spec in enumerate(_order(MODES[speculation])):
            rows.append(run_level(url, headers, c, seconds, max_tokens, timeout_s, prompts, spec, requests, start,
                                  level[j] if level else None))
            r = rows[-1]
            turns = r["ttft_p50_ms_by_turn"]
            by_turn = (", first token by turn " + " / ".join(_fmt(t, ".0f") for t in turns) + " ms"
                       if len(turns) > 1 else "")
            print(f"level {c} speculation {'on' if spec else 'off'}: {r['ok']} ok, "
                  f"{r['completion_tok_per_s']:.1f} tok/s, {r['rejected']} refused{by_turn}", flush=True)
        cursors += level
        # the next level's requests are new to the server
        start = max(cur.end for cur in level) if level else start + c * requests
    print(format_table(rows), flush=True)
    result = {"url": url, "path": CHAT_PATH, "max_tokens": max_tokens,
              "seconds_per_level": seconds if requests is None else None, "requests_per_client": requests,
              "timeout_s": timeout_s, "prompts": len(prompts), "levels": rows}
    if requests is None:  # the timed levels' prompts (module doc)
        sent, repeats = sum(cur.taken for cur in cursors), sum(cur.repeats for cur in cursors)
        result.update(prompts_sent=sent, distinct_prompts=min(start, len(prompts)), repeated_prompts=repeats)
        if repeats:
            print(f"note: {repeats} of {sent} timed requests repeated an earlier level's prompt (the list has "
                  f"{len(prompts)}): the server had answered those before", flush=True)
    result["ratios"] = ratios(rows)
    if long_prompt:
        result["long_prompt"] = long_prompt_probe(url, headers, timeout_s=max(timeout_s, 120.0),
                                                  prompts=first_turns(prompts))
        lp = result["long_prompt"]
        print(f"long prompt ({lp['prompt_words']} words) beside {lp['streams']} streams: TTFT "
              f"{_fmt(lp['long_ttft_ms'], '.0f')} ms; the streams' gap {_fmt(lp['gap_before_p50_ms'], '.0f')} ms "
              f"before, at most {_fmt(lp['gap_during_max_ms'], '.0f')} ms during its prefill "
              f"({_fmt(lp['max_gap_in_decode_steps'], '.2f')} decode steps)", flush=True)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    if png_path is not None:
        write_chart(result, png_path)
    return result


# -- the command line: `osd bench load` --------------------------------------------------------

HELP = "closed-loop streaming chat load on a running server at rising concurrency, speculation on and off"
ERRORS = (LoadBenchError,)


def add_arguments(bl: argparse.ArgumentParser) -> None:
    bl.add_argument("--url", help="server base URL (default http://{serve.host}:{serve.port})")
    bl.add_argument("--api-key", help="Bearer key (default $OSD_API_KEY)")
    bl.add_argument("--levels", default="1,2,4,8,16", metavar="C,C,...", help="concurrency levels (default 1,2,4,8,16)")
    bl.add_argument("--seconds", type=float, default=20, metavar="S", help="seconds per level and mode (default 20)")
    bl.add_argument("--requests", type=int, metavar="N",
                    help="instead of --seconds: each client sends N requests, the same ones in each mode "
                         "(speculation on first)")
    bl.add_argument("--max-tokens", type=int, default=64, metavar="M", help="max_tokens per request (default 64)")
    bl.add_argument("--speculation", choices=("both", "on", "off"), default="both",
                    help="run each level with speculation on and off (default), or one of them")
    bl.add_argument("--prompts", default="sharegpt", metavar="SRC",
                    help="sharegpt (held-out first turns, default), a JSONL file of {\"prompt\": ...}, or fixed")
    bl.add_argument("--workload", choices=("single", "multiturn"), default="single",
                    help="multiturn: each request is a held-out ShareGPT conversation's two user turns, the second "
                         "sent with the server's answer to the first (--prompts is not used)")
    bl.add_argument("--timeout", type=float, default=60, metavar="S", help="per-request client timeout (default 60)")
    bl.add_argument("--out", "--json", dest="out", default="reports/bench/load.json", metavar="PATH",
                    help="where to write JSON")
    bl.add_argument("--png", metavar="PATH", help="the chart (default: the JSON's path with .png)")
    bl.add_argument("--long-prompt", action="store_true",
                    help="then: 7 streams and one ~1,900-token prompt; how long its prefill stalls them")


def run(cfg: Any, args: argparse.Namespace) -> int:
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise LoadBenchError(f"--levels must be comma-separated integers, got {args.levels!r}") from None
    url = args.url or f"http://{cfg.serve.host}:{cfg.serve.port}"
    if args.workload == "multiturn":
        prompts = load_conversations(cfg)
    else:
        prompts = load_prompts(args.prompts) if args.prompts != "fixed" else None
    png = args.png or str(Path(args.out).with_suffix(".png"))
    run_load_bench(url, api_key=args.api_key, levels=levels, seconds=args.seconds, max_tokens=args.max_tokens,
                   timeout_s=args.timeout, speculation=args.speculation, prompts=prompts, json_path=args.out,
                   png_path=png, long_prompt=args.long_prompt, requests=args.requests)
    return 0
