"""The ops summary behind `/ops` and `/ops/api/summary`: one JSON document that says which draft
serves, whether the canary is winning and by how much, and whether the loop is healthy.

    registry (aliases, versions, audit) ─┐
    Redis: stream records, groups, status ├─> OpsSource.summary() ─> JSON ─> serve/api/ops/page.py
    replicas' recent requests + counters ─┘

It reads only (XREVRANGE, XINFO, HGETALL; no consumer group), so opening the page never moves
the trainers' or the controller's place in the stream. Numbers are computed by serve/api/ops/stats.py.
"""

from __future__ import annotations

import time
from typing import Any

from infra.config import OSDConfig
from serve.api.ops import adapt
from serve.api.ops import stats as st

WINDOW_S = 3600.0  # the page's default span: rows, charts and the registry's recent history
MAX_RECORDS = 5000  # newest records read per summary; bounds the page's cost on a busy stream
BUCKETS = 30
MIN_SPAN_S = 120.0
ADAPT_EVERY = 4  # the poller's time-to-adapt gauges: every 4th stream poll (a minute by default)


class OpsSource:
    def __init__(self, cfg: OSDConfig, registry: Any = None, client: Any = None):
        from infra.registry import Registry
        from infra.records.streams import connect

        self.cfg = cfg
        self.registry = registry or Registry.from_config(cfg)
        self.client = client if client is not None or not cfg.stream.redis_url else connect(
            cfg.stream.redis_url, cfg.stream, role="trainer")

    # -- reading ---------------------------------------------------------------

    def evidence(self, since: float) -> list[st.Evidence]:
        """The newest records since `since` (at most MAX_RECORDS), oldest first, as evidence."""
        return self.read(since)[0]

    def read(self, since: float) -> tuple[list[st.Evidence], list[tuple[float, str]]]:
        """The newest records since `since` (at most MAX_RECORDS), oldest first: the drafted
        ones as evidence, and every one's (time, domain) for the shift detector."""
        from infra.records.schema import RecordError, decode
        from infra.records.streams import FIELD

        if self.client is None:
            return [], []
        entries = self.client.xrevrange(self.cfg.stream.stream, max="+", min=f"{int(since * 1000)}-0",
                                        count=MAX_RECORDS)
        out, points = [], []
        for _, fields in reversed(entries):
            try:
                rec = decode(fields[FIELD])
            except (KeyError, RecordError):
                continue  # the consumers dead-letter it; the page just skips it
            points.append((rec.created_at, rec.domain))
            e = st.evidence_of(rec.created_at, rec.draft_version, rec.accepted.tolist(), rec.draft_tokens.tolist())
            if e is not None:
                out.append(e)
        return out, points

    def adapt(self, evidence: list[st.Evidence], points: list[tuple[float, str]], audit: list[dict[str, Any]],
              now: float) -> dict[str, Any] | None:
        """Time to adapt (serve/api/ops/adapt.py) over what `read` returned."""
        shift = adapt.last_shift(points)
        after = st.aggregate(e for e in evidence if shift is not None and e.time >= shift["time"])
        acceptance = {v: a.acceptance.ratio for v, a in after.items() if a.acceptance.n}
        return adapt.time_to_adapt(shift, audit, acceptance, now)

    def stream_health(self) -> dict[str, Any]:
        if self.client is None:
            return {"length": None, "dead_lettered": None, "groups": [], "status": {}, "starts": {}}
        return stream_health(self.client, self.cfg.stream.stream)

    # -- the document ------------------------------------------------------------

    def summary(self, replicas: list[dict[str, Any]] | None = None, now: float | None = None,
                window_s: float = WINDOW_S) -> dict[str, Any]:
        """replicas: each replica's stats() (its counters and recent requests); [] for none."""
        now = time.time() if now is None else now
        t0 = now - window_s
        replicas = replicas or []
        aliases = self.registry.aliases()
        audit = self.registry.audit_log()
        stable = (aliases.get("stable") or {}).get("version")
        canary_alias = aliases.get("canary")
        canary = canary_alias["version"] if canary_alias else None
        problems: list[str] = []  # shown on the page: a Redis outage must not blank it
        evidence, points = _guarded(lambda: self.read(t0), ([], []), problems)
        aggs = st.aggregate(evidence)
        serving: dict[str, list[dict[str, Any]]] = {}
        for r in replicas:
            for s in r.get("recent", []):
                if s["time"] >= t0:
                    serving.setdefault(s["version"], []).append(s)
        rows = st.version_rows(aggs, serving, stable, canary)
        markers = st.decision_markers(audit, t0, now)
        # Charts start at the window's first data (a young stack's minutes fill the width), at least MIN_SPAN_S.
        c0 = max(t0, min([e.time for e in evidence] + [mk["time"] for mk in markers] + [now - MIN_SPAN_S]))
        order = {r["version"]: i for i, r in enumerate(rows)}  # charts list versions as the table does

        def ordered(d: dict[str, Any]) -> dict[str, Any]:
            return dict(sorted(d.items(), key=lambda kv: order.get(kv[0], len(order))))

        return {
            "as_of": now, "window_s": window_s,
            "header": self._header(aliases, audit),
            "versions": rows,
            "comparison": self._comparison(evidence, audit, stable, canary_alias),
            "charts": {"from": c0, "acceptance": ordered(st.acceptance_series(evidence, c0, now, BUCKETS)),
                       "markers": markers, "per_position": ordered(st.per_position(aggs)),
                       "canary_weight": st.weight_series(audit, c0, now, _current_weight(aliases)),
                       "batch_size": st.batch_series(replicas, c0)},
            "loop": self._loop(replicas, problems),
            "adapt": self.adapt(evidence, points, audit, now),
            "problems": problems,
            "registry": self._registry(audit),
        }

    def _header(self, aliases: dict[str, Any], audit: list[dict[str, Any]]) -> dict[str, Any]:
        stable, canary = aliases.get("stable"), aliases.get("canary")
        steps = list(self.cfg.rollout.canary_steps)
        weight = float(canary["weight"]) if canary else 0.0
        step = next((i + 1 for i, w in enumerate(steps) if abs(w - weight) < 1e-9), None) if canary else None
        decisions = [e for e in audit if e.get("action") in st.DECISIONS]
        last = decisions[-1] if decisions else None
        return {"stable": stable and stable["version"], "canary": canary and canary["version"],
                "canary_weight": weight, "canary_step": step, "canary_steps": steps,
                "last_decision": last and {"action": last.get("action"), "version": last.get("version"),
                                           "reason": last.get("reason", ""), "time": last.get("time"),
                                           "manual": bool(last.get("manual"))}}

    def _comparison(self, evidence: list[st.Evidence], audit: list[dict[str, Any]], stable: str | None,
                    canary_alias: dict[str, Any] | None) -> dict[str, Any] | None:
        """Canary minus stable over the controller's window (since it started or last advanced
        this canary), with the controller's thresholds; None without a canary."""
        if not stable or not canary_alias:
            return None
        canary = canary_alias["version"]
        since = st.window_start(audit, canary) or float(canary_alias.get("updated_at") or 0.0)
        aggs = st.aggregate(e for e in evidence if e.time >= since)
        weight = float(canary_alias["weight"])
        nxt = [w for w in self.cfg.rollout.canary_steps if w > weight]
        out = st.canary_vs_stable(aggs, stable, canary, self.cfg.rollout, self.cfg.serve.k,
                                  final=not nxt or nxt[0] >= 1.0)
        out["since"] = since
        return out

    def _loop(self, replicas: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
        dropped: dict[str, int] = {}
        for r in replicas:
            for reason, n in (r.get("dropped_by_reason") or {}).items():
                dropped[reason] = dropped.get(reason, 0) + int(n)
        health = _guarded(self.stream_health, {"length": None, "dead_lettered": None, "groups": [], "status": {},
                                               "starts": {}, "last_recovery": None}, problems)
        trainers = sorted((dict(v, component=k) for k, v in health.pop("status").items()
                           if k.startswith("trainer-")), key=lambda t: t["component"])
        versions = self.registry.list()
        last = versions[-1] if versions else None
        suffix = [r["suffix"] for r in replicas if r.get("suffix")]
        return {"records_written": sum(int(r.get("records_written", 0)) for r in replicas),
                # Written from the spool a killed replica left (infra/records/spool.py): not lost.
                "records_replayed": sum(int(r.get("records_replayed", 0)) for r in replicas),
                "records_dropped": dropped,
                # Starts beyond the first of each trainer rank and the rollout controller.
                "restarts": {k: n - 1 for k, n in sorted(health.pop("starts").items())},
                "last_recovery": health.pop("last_recovery", None), "replicas": len(replicas), "stream": health, "trainers": trainers,
                # The suffix draft's replica indexes (none unless it serves): size and hit rate.
                "suffix": suffix and {"tokens": sum(x["global_tokens"] for x in suffix),
                                      "bytes": sum(x["global_bytes"] for x in suffix),
                                      "proposal_rate": sum(x["proposal_rate"] for x in suffix) / len(suffix)},
                "by_source": st.by_source(replicas),
                "last_candidate": last and {"version": last.id, "alpha_est": last.metrics.get("alpha_est"),
                                            "created_at": last.created_at}}

    def _registry(self, audit: list[dict[str, Any]]) -> dict[str, Any]:
        versions = [{"version": v.id, "parent": v.lineage.get("parent"),
                     "records_consumed": v.lineage.get("records_consumed"),
                     "alpha_est": v.metrics.get("alpha_est"), "created_at": v.created_at}
                    for v in reversed(self.registry.list())]
        history = [{"time": e.get("time"), "action": e.get("action"), "version": e.get("version"),
                    "weight": e.get("weight"), "reason": e.get("reason", ""), "manual": bool(e.get("manual"))}
                   for e in reversed(audit[-50:])]
        return {"versions": versions, "alias_history": history}


def stream_health(client: Any, name: str) -> dict[str, Any]:
    """Length, dead letters, each group's lag (Redis 7's XINFO GROUPS) and the loop's status hash."""
    from infra.redis.loop_status import last_recovery, read_all, read_starts
    from infra.records.streams import dead_letter_stream, group_info

    groups = [{"group": g, "lag": _int(i.get("lag")), "pending": _int(i.get("pending")),
               "consumers": _int(i.get("consumers")), "last_delivered": i.get("last-delivered-id")}
              for g, i in sorted(group_info(client, name).items())]
    starts = read_starts(client, name)
    return {"length": client.xlen(name), "dead_lettered": client.xlen(dead_letter_stream(name)),
            "groups": groups, "status": read_all(client, name), "starts": starts,
            "last_recovery": last_recovery(starts, client, name)}


def _current_weight(aliases: dict[str, Any]) -> tuple[float, float]:
    canary = aliases.get("canary")
    # No canary: no time to place the drop at, so it shows at the end (now).
    return (float(canary.get("updated_at") or 0.0), float(canary["weight"])) if canary else (float("inf"), 0.0)


def _guarded(read: Any, empty: Any, problems: list[str]) -> Any:
    """read(), or `empty` with the reason noted when Redis cannot answer."""
    from redis.exceptions import RedisError

    try:
        return read()
    except (RedisError, OSError) as e:
        problems.append(f"Redis: {type(e).__name__}: {e}"[:300])
        return empty


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


class StreamPoller:
    """Sets the stream gauges (serve/api/metrics.py StreamMetrics) every period_s from a daemon
    thread, so Prometheus has the lag whether or not anyone opens the page."""

    def __init__(self, cfg: OSDConfig, period_s: float = 15.0):
        import threading

        self.cfg, self.period_s = cfg, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="osd-stream-poller", daemon=True)

    def start(self) -> "StreamPoller":
        if self.cfg.stream.redis_url:
            self._thread.start()
        return self

    def _run(self) -> None:
        from infra.records.streams import connect
        from serve.api.metrics import StreamMetrics

        gauges = StreamMetrics()
        client = connect(self.cfg.stream.redis_url, self.cfg.stream, role="trainer")
        source: OpsSource | None = None
        polls = 0
        while not self._stop.is_set():
            try:
                h = stream_health(client, self.cfg.stream.stream)
                gauges.set(self.cfg.stream.stream, h["length"] or 0, h["groups"])
                if polls % ADAPT_EVERY == 0:  # reads up to MAX_RECORDS records: not every poll
                    source = source or OpsSource(self.cfg, client=client)
                    now = time.time()
                    evidence, points = source.read(now - WINDOW_S)
                    gauges.set_adapt(source.adapt(evidence, points, source.registry.audit_log(), now))
            except Exception:  # Redis or the registry away for a while: the gauges keep their last values
                pass
            polls += 1
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
