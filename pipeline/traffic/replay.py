"""Load replay against an OpenAI-compatible endpoint (`osd replay`).

Sends prompts (ShareGPT or a JSONL file) to `{url}/v1/chat/completions` (or `/v1/completions`)
and summarises what came back: ok / failed (by HTTP status), latency percentiles, completion
tokens per second, the server's speculative-decoding figures (the `osd` extension object of
each response) and how many training records the server wrote or dropped meanwhile (deltas of
`GET {url}/osd/stats`).

Two loops, both bounded by the number of prompts (each prompt is sent once, or twice in
compare mode), by a per-request timeout and optionally by a total duration; neither retries:
  * closed loop: `concurrency` workers, each sends its next request when the last one returned;
  * open loop: requests start at Poisson arrival times of `rate` per second (seeded), whether
    or not earlier ones returned, which is how independent users arrive.

Compare mode (`compare_recording=True`) sends every prompt twice in one run, once with
`"osd_record": true` and once with false, alternating which goes first, and reports the
latency overhead of the record path.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import httpx
from tabulate import tabulate

from infra.config import OSDConfig
from infra.prompts import Prompt
from infra.common.stats import percentile  # noqa: F401 (re-exported)

MODEL_NAME = "osd"
MAX_ERRORS_KEPT = 5
STATS_PATH = "/osd/stats"
# After the run the server's producer may still be writing the last records: re-read the stats
# until two reads agree, at most this long.
STATS_SETTLE_S = 2.0
STATS_POLL_S = 0.25
STATS_TIMEOUT_S = 10.0

# failed_by_status keys for failures that have no HTTP status.
CONNECT, TIMEOUT, CLIENT_ERROR, BAD_RESPONSE = "connect", "timeout", "client_error", "bad_response"


class ReplayError(Exception):
    """Bad replay parameters or an unreachable endpoint; the CLI prints the message, exit 2."""


class ReplayConnectionError(ReplayError):
    """Nothing answers at the URL (connection refused, unknown host, connect timeout)."""


# -- one request -----------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_index: int
    record: bool | None  # the osd_record value sent (None: field omitted)
    ok: bool
    status: str | None  # failed_by_status key: the HTTP status, or connect / timeout / ...
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    draft_version: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_accepted_len: float | None = None
    # drafting steps by who proposed: source -> {"steps", "drafted", "accepted"}
    drafted_by_source: dict | None = None
    error: str | None = None


def build_body(text: str, *, chat: bool, max_tokens: int, temperature: float,
               record: bool | None, model: str = MODEL_NAME,
               messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """messages: a whole conversation (a {"messages"} prompt line), sent as it is on chat."""
    body: dict[str, Any] = {"model": model}
    if chat:
        body["messages"] = messages or [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update(max_tokens=max_tokens, temperature=temperature, stream=False)
    if record is not None:
        body["osd_record"] = bool(record)
    return body


def _error_message(status: int, text: str) -> str:
    try:
        err = json.loads(text)["error"]
        msg = str(err.get("message", ""))
        typ = err.get("type")
        return f"{status} {typ}: {msg}" if typ else f"{status}: {msg}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{status}: {text.strip()[:200]}"


def parse_response(data: Any, *, chat: bool) -> dict[str, Any]:
    """The fields a summary needs from one OpenAI-shaped response; KeyError/TypeError/ValueError if
    it is not one."""
    choice = data["choices"][0]
    if chat:
        text = choice["message"]["content"]
    else:
        text = choice["text"]
    if not isinstance(text, str):
        raise ValueError("completion text is not a string")
    usage = data.get("usage") or {}
    osd = data.get("osd") or {}
    mal = osd.get("mean_accepted_len")
    return {
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
        "draft_version": osd.get("draft_version"),
        "num_draft_tokens": int(osd.get("num_draft_tokens") or 0),
        "num_accepted_tokens": int(osd.get("num_accepted_tokens") or 0),
        "mean_accepted_len": None if mal is None else float(mal),
        "drafted_by_source": osd.get("drafted_by_source") or {},
    }


async def _one(session: httpx.AsyncClient, endpoint: str, body: dict[str, Any], index: int,
               record: bool | None, chat: bool, timeout_s: float) -> RequestResult:
    t0 = time.perf_counter()

    def fail(status: str, error: str) -> RequestResult:
        return RequestResult(index, record, False, status, time.perf_counter() - t0, error=error)

    try:
        # timeout_s bounds the whole request, waiting for a connection included
        resp = await asyncio.wait_for(session.post(endpoint, json=body), timeout_s)
    except httpx.ConnectError as e:
        return fail(CONNECT, f"cannot connect: {_reason(e)}")
    except (httpx.TimeoutException, asyncio.TimeoutError):
        return fail(TIMEOUT, "timed out")
    except httpx.HTTPError as e:
        return fail(CLIENT_ERROR, f"{type(e).__name__}: {e}")
    text = resp.text
    latency = time.perf_counter() - t0
    status = resp.status_code
    if status >= 400:
        return RequestResult(index, record, False, str(status), latency, error=_error_message(status, text))
    try:
        fields = parse_response(json.loads(text), chat=chat)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return RequestResult(index, record, False, BAD_RESPONSE, latency,
                             error=f"{status}: not an OpenAI response ({type(e).__name__}: {e}): "
                                   f"{text.strip()[:200]}")
    return RequestResult(index, record, True, str(status), latency, **fields)


# -- server stats ----------------------------------------------------------------------------


async def _get_stats(session: httpx.AsyncClient, base: str, *, strict: bool) -> dict[str, Any] | None:
    """GET /osd/stats as a dict, None if the route is missing or answers garbage. With strict,
    an unreachable server raises ReplayConnectionError (the pre-flight check)."""
    try:
        resp = await asyncio.wait_for(session.get(base + STATS_PATH, timeout=STATS_TIMEOUT_S), STATS_TIMEOUT_S)
        if resp.status_code != 200:
            return None
        data = resp.json()
        return data if isinstance(data, dict) else None
    except (httpx.ConnectError, httpx.TimeoutException, asyncio.TimeoutError) as e:
        if strict:
            raise ReplayConnectionError(f"cannot connect to {base}: {_reason(e)} (is the server running? "
                                        f"start it with `osd serve` or pass --url)") from None
        return None
    except (httpx.HTTPError, ValueError):
        return None


def _reason(e: BaseException) -> str:
    """Why a connection failed, in a few words: the OS error under httpx's, if there is one."""
    if isinstance(e, (httpx.TimeoutException, asyncio.TimeoutError)):
        return "timed out"
    chain: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(c, ConnectionRefusedError) for c in chain):
        return "connection refused"
    os_err = next((c for c in reversed(chain) if isinstance(c, OSError)), None)  # the innermost
    return str(getattr(os_err, "strerror", None) or os_err or e)


def _delta(before: dict | None, after: dict | None, key: str) -> int | None:
    try:
        return int(after[key]) - int(before[key])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None


async def _settled_stats(session: httpx.AsyncClient, base: str) -> dict[str, Any] | None:
    after = await _get_stats(session, base, strict=False)
    deadline = time.monotonic() + STATS_SETTLE_S
    while after is not None and time.monotonic() < deadline:
        await asyncio.sleep(STATS_POLL_S)
        again = await _get_stats(session, base, strict=False)
        if again is None:
            break
        keys = ("records_written", "records_dropped")
        if all(again.get(k) == after.get(k) for k in keys):
            return again
        after = again
    return after


# -- summaries -------------------------------------------------------------------------------


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed_by: dict[str, int] = {}
    errors: list[str] = []
    for r in results:
        if not r.ok:
            failed_by[r.status or "unknown"] = failed_by.get(r.status or "unknown", 0) + 1
            if r.error and len(errors) < MAX_ERRORS_KEPT:
                errors.append(r.error)
    lat = [r.latency_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    drafted = sum(r.num_draft_tokens for r in ok)
    accepted = sum(r.num_accepted_tokens for r in ok)
    # mean_accepted_len is emitted tokens per target step; a response's step count is about
    # completion_tokens / its mean_accepted_len, so the aggregate over all steps is
    # sum(tokens) / sum(steps), not the plain mean of the per-response values.
    steps = [(r.completion_tokens, r.completion_tokens / r.mean_accepted_len)
             for r in ok if r.mean_accepted_len and r.completion_tokens]
    versions: dict[str, int] = {}
    for r in ok:
        if r.draft_version is not None:
            versions[str(r.draft_version)] = versions.get(str(r.draft_version), 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "failed_by_status": dict(sorted(failed_by.items())),
        "errors": errors,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": statistics.fmean(lat) if lat else None,
        "tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "tok_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_len": (sum(t for t, _ in steps) / sum(s for _, s in steps)) if steps else None,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "draft_versions": versions,
        "finish_reasons": _count(r.finish_reason for r in ok),
        "wall_s": wall_s,
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def compare_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Record path overhead from pairs of the same prompt sent with osd_record true and false.

    The overhead is the median over prompts of latency(on) / latency(off) - 1, not the ratio of
    the two overall medians: prompts differ in length by far more than recording costs, so
    pairing each prompt with itself (same tokens under greedy decoding, sent back to back)
    cancels that spread and leaves mostly the recording cost plus scheduling noise."""
    on = {r.prompt_index: r for r in results if r.record is True and r.ok}
    off = {r.prompt_index: r for r in results if r.record is False and r.ok}
    pairs = sorted(set(on) & set(off))
    ratios = [on[i].latency_s / off[i].latency_s for i in pairs if off[i].latency_s > 0]
    med_on = statistics.median(on[i].latency_s for i in pairs) if pairs else None
    med_off = statistics.median(off[i].latency_s for i in pairs) if pairs else None
    return {
        "pairs": len(ratios),
        "latency_p50_record_on_s": med_on,
        "latency_p50_record_off_s": med_off,
        "record_path_overhead_pct": 100.0 * (statistics.median(ratios) - 1.0) if ratios else None,
        "record_path_overhead_pct_of_medians": (100.0 * (med_on / med_off - 1.0)
                                                if med_on is not None and med_off else None),
    }


# -- loops -----------------------------------------------------------------------------------


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Start offsets (s) of n requests of a Poisson process at `rate`/s: the first at 0, then
    exponential gaps of mean 1/rate. The same seed gives the same schedule."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for j in range(n):
        if j:
            at += rng.expovariate(rate)
        out.append(at)
    return out


Job = tuple[int, "bool | None"]  # (prompt index, osd_record value)


async def _run_jobs(jobs: list[Job], send: Callable[[int, bool | None], Any], *, concurrency: int | None,
                    rate: float | None, seed: int, deadline: float | None,
                    on_done: Callable[[RequestResult], None]) -> tuple[list[RequestResult], int]:
    """Run the jobs in a closed loop (concurrency) or an open loop (rate); returns the results in
    job order and how many jobs were not started because the deadline passed."""
    results: list[RequestResult | None] = [None] * len(jobs)

    async def run(j: int) -> None:
        res = await send(*jobs[j])
        results[j] = res
        on_done(res)

    def expired() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    if rate is not None:
        tasks = []
        t0 = time.monotonic()
        for j, at in enumerate(arrival_times(len(jobs), rate, seed)):
            wait = t0 + at - time.monotonic()
            if deadline is not None and t0 + at >= deadline:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(run(j)))
        if tasks:
            await asyncio.gather(*tasks)
    else:
        next_job = 0

        async def worker() -> None:
            nonlocal next_job
            while next_job < len(jobs) and not expired():
                j, next_job = next_job, next_job + 1
                await run(j)

        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency or 1, len(jobs))))))
    done = [r for r in results if r is not None]
    return done, len(jobs) - len(done)


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ReplayError(f"--url must be an http:// or https:// URL, got {url!r}")
    return url.rstrip("/")


async def _replay(base: str, prompts: Sequence[Prompt], jobs: list[Job], *, concurrency: int | None,
                  rate: float | None, max_tokens: int, temperature: float, chat: bool, api_key: str | None,
                  timeout_s: float, duration_s: float | None, seed: int, progress: bool
                  ) -> tuple[list[RequestResult], int, float, dict | None, dict | None]:
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = base + ("/v1/chat/completions" if chat else "/v1/completions")
    # Closed loop: one connection per worker. Open loop: enough that the client never queues
    # requests the server would not (waiting for a connection still counts in the latency).
    limit = concurrency if rate is None else min(len(jobs), 256)
    limits = httpx.Limits(max_connections=max(1, limit or 1), max_keepalive_connections=max(1, limit or 1))
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits) as session:
        before = await _get_stats(session, base, strict=True)  # also the "is anything there" check
        bar = tqdm(total=len(jobs), file=sys.stderr, disable=not progress, unit="req", desc="replay",
                   dynamic_ncols=True)
        counts = {"ok": 0, "failed": 0}

        def on_done(r: RequestResult) -> None:
            counts["ok" if r.ok else "failed"] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update(1)

        async def send(i: int, record: bool | None) -> RequestResult:
            body = build_body(prompts[i].text, chat=chat, max_tokens=max_tokens, temperature=temperature,
                              record=record, messages=prompts[i].chat() if prompts[i].messages else None)
            return await _one(session, endpoint, body, i, record, chat, timeout_s)

        deadline = time.monotonic() + duration_s if duration_s else None
        t0 = time.perf_counter()
        try:
            results, not_sent = await _run_jobs(jobs, send, concurrency=concurrency, rate=rate, seed=seed,
                                                deadline=deadline, on_done=on_done)
        finally:
            bar.close()
        wall = time.perf_counter() - t0
        after = await _settled_stats(session, base) if before is not None else None
    return results, not_sent, wall, before, after


def run_replay(cfg: OSDConfig, url: str, *, prompts: Sequence[Prompt], concurrency: int | None = None,
               rate: float | None = None, max_tokens: int = 64, temperature: float = 0.0, chat: bool = True,
               api_key: str | None = None, record: bool | None = None, timeout_s: float = 120,
               progress: bool = True, json_path: str | Path | None = None, compare_recording: bool = False,
               duration_s: float | None = None, seed: int = 0,
               log: Callable[[str], None] = lambda s: print(s, flush=True)) -> dict[str, Any]:
    """Replay `prompts` against `url`; print a table, return the summary (and write it as JSON).

    `concurrency` (default 4; 1 in compare mode) runs a closed loop; `rate` (requests/s) an open
    loop with Poisson arrivals seeded by `seed`; not both. `record` sets the `osd_record` field
    of every request (None: omitted, the server decides). `duration_s` stops starting requests
    after that many seconds (in-flight ones finish, each bounded by `timeout_s`).
    Raises ReplayConnectionError if nothing answers at `url`."""
    base = _base_url(url)
    if not prompts:
        raise ReplayError("no prompts to replay (check --prompts, --domain, --max-prompt-chars)")
    if not chat and any(p.messages for p in prompts):
        raise ReplayError('{"messages"} prompts are conversations: replay them on chat completions, '
                          'not /v1/completions')
    if concurrency is not None and rate is not None:
        raise ReplayError("give --concurrency (closed loop) or --rate (open loop), not both")
    if concurrency is not None and concurrency < 1:
        raise ReplayError(f"concurrency must be >= 1, got {concurrency}")
    if rate is not None and not rate > 0:
        raise ReplayError(f"rate must be > 0 requests/s, got {rate}")
    if max_tokens < 1:
        raise ReplayError(f"max_tokens must be >= 1, got {max_tokens}")
    if timeout_s <= 0:
        raise ReplayError(f"timeout must be > 0, got {timeout_s}")
    if compare_recording and record is not None:
        raise ReplayError("compare mode sends osd_record both ways; do not also set record")
    if rate is None and concurrency is None:
        concurrency = 1 if compare_recording else 4
    api_key = api_key if api_key is not None else (os.environ.get("OSD_API_KEY") or None)

    if compare_recording:
        # Each prompt with and without recording, alternating which goes first so that neither
        # mode always meets a warmer (or busier) server.
        jobs: list[Job] = []
        for i in range(len(prompts)):
            first = i % 2 == 0
            jobs += [(i, first), (i, not first)]
    else:
        jobs = [(i, record) for i in range(len(prompts))]

    results, not_sent, wall, before, after = asyncio.run(_replay(
        base, prompts, jobs, concurrency=concurrency, rate=rate, max_tokens=max_tokens,
        temperature=temperature, chat=chat, api_key=api_key, timeout_s=timeout_s, duration_s=duration_s,
        seed=seed, progress=progress))

    summary = summarize(results, wall)
    summary["not_sent"] = not_sent
    summary["records_written"] = _delta(before, after, "records_written")
    summary["records_dropped"] = _delta(before, after, "records_dropped")
    summary["params"] = {
        "url": base, "endpoint": "/v1/chat/completions" if chat else "/v1/completions",
        "prompts": len(prompts), "concurrency": concurrency, "rate": rate, "seed": seed,
        "max_tokens": max_tokens, "temperature": temperature, "record": record,
        "compare_recording": compare_recording, "timeout_s": timeout_s, "duration_s": duration_s,
        "auth": bool(api_key),
    }
    if compare_recording:
        summary["compare"] = compare_summary(results)
        summary["by_record"] = {
            "on": summarize([r for r in results if r.record is True], wall),
            "off": summarize([r for r in results if r.record is False], wall),
        }
    _print_table(summary, log)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# -- table -----------------------------------------------------------------------------------


def _f(x: Any, fmt: str = "{:,.3f}") -> str:
    return "unknown" if x is None else fmt.format(x)


def _print_table(s: dict[str, Any], log: Callable[[str], None]) -> None:
    p = s["params"]
    loop = f"open loop {p['rate']:g} req/s" if p["rate"] is not None else f"closed loop x{p['concurrency']}"
    log(f"replay: {s['requests']} requests to {p['url']}{p['endpoint']}, {loop}, max_tokens {p['max_tokens']}, "
        f"temperature {p['temperature']:g}" + (", compare recording" if p["compare_recording"] else ""))
    failed = f"{s['ok']} / {s['failed']}"
    if s["failed_by_status"]:
        failed += "  (" + ", ".join(f"{k}: {v}" for k, v in s["failed_by_status"].items()) + ")"
    rows = [
        ("ok / failed", failed),
        ("latency p50 / p99 (s)", f"{_f(s['latency_p50_s'])} / {_f(s['latency_p99_s'])}"),
        ("completion tokens", f"{s['tokens']:,}"),
        ("tok/s", _f(s["tok_s"], "{:,.1f}")),
        ("requests/s", _f(s["requests_per_s"], "{:,.2f}")),
        ("acceptance rate", _f(s["acceptance_rate"])),
        ("mean accepted len", _f(s["mean_accepted_len"], "{:,.2f}")),
        ("records written / dropped", f"{_f(s['records_written'], '{:,}')} / {_f(s['records_dropped'], '{:,}')}"),
        ("wall (s)", _f(s["wall_s"], "{:,.2f}")),
    ]
    if s.get("not_sent"):
        rows.append(("not sent (duration)", str(s["not_sent"])))
    if "compare" in s:
        c = s["compare"]
        rows += [
            ("pairs (both ok)", str(c["pairs"])),
            ("p50 latency record on / off (s)",
             f"{_f(c['latency_p50_record_on_s'])} / {_f(c['latency_p50_record_off_s'])}"),
            ("record path overhead (median of pair ratios)", _f(c["record_path_overhead_pct"], "{:+.1f} %")),
        ]
    for line in tabulate(rows, tablefmt="plain", disable_numparse=True).splitlines():
        log(f"  {line}")
    for e in s["errors"]:
        log(f"  error: {e}")
