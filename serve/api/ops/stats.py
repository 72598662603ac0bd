"""The ops page's numbers, as pure functions over records, serving samples and audit entries.

Two sources, each for what only it knows:
- records (the stream): acceptance, mean accepted length and per-position acceptance per
  version, counted exactly as the rollout controller counts them (infra/common/canary_stats.py), so
  the page's canary-minus-stable interval is the controller's own;
- serving samples (each replica's recent requests, serve/api/metrics.py `RecentRequests`):
  requests, output tokens/s, latency percentiles and errors, which records do not carry
  (a failed request writes no record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from infra.common.canary_stats import LEN_MARGIN, MIN_GAIN, TAU, RatioStats, RequestSample, compare_ratios, request_sample
from infra.common.stats import percentile  # noqa: F401 (re-exported)

Z95 = 1.959964  # two-sided 95% normal quantile, for one version's own interval


@dataclass(frozen=True)
class Evidence:
    """One record's evidence: the controller's sample plus where in the step each draft stood."""

    time: float
    version: str
    sample: RequestSample
    accepted_at: tuple[int, ...]  # [k] draft tokens accepted at position j of a step
    drafting_steps: int  # steps with at least one draft token judged (vLLM's num_drafts)


def evidence_of(time: float, version: str, accepted: Sequence[bool], draft_tokens: Sequence[int]) -> Evidence | None:
    """None for records with nothing drafted (autoregressive, or version "none")."""
    sample = request_sample(accepted, draft_tokens)
    if sample is None or version == "none":
        return None
    at: list[int] = []
    drafting, j = 0, 0
    for acc, tok in zip(accepted, draft_tokens):
        if j == 0 and (acc or tok >= 0):
            drafting += 1  # the first judged draft token of a step
        if acc:
            at.extend([0] * (j + 1 - len(at)))
            at[j] += 1
            j += 1
        else:
            j = 0  # the target's own token ends the step
    return Evidence(time, version, sample, tuple(at), drafting)


@dataclass
class VersionAgg:
    """Sums over one version's evidence and serving samples."""

    acceptance: RatioStats = field(default_factory=RatioStats)
    length: RatioStats = field(default_factory=RatioStats)
    accepted_at: list[int] = field(default_factory=list)
    drafting_steps: int = 0
    records: int = 0

    def add(self, e: Evidence) -> None:
        self.records += 1
        self.acceptance.add(e.sample.accepted, e.sample.judged)
        self.length.add(e.sample.tokens, e.sample.steps)
        self.drafting_steps += e.drafting_steps
        self.accepted_at.extend([0] * (len(e.accepted_at) - len(self.accepted_at)))
        for j, n in enumerate(e.accepted_at):
            self.accepted_at[j] += n


def aggregate(evidence: Iterable[Evidence]) -> dict[str, VersionAgg]:
    out: dict[str, VersionAgg] = {}
    for e in evidence:
        out.setdefault(e.version, VersionAgg()).add(e)
    return out


def serving_row(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """samples: {"latency_s", "tokens", "decode_s", "error"} of one version (error: reason or None)."""
    ok = [s for s in samples if not s["error"]]
    decode_s = sum(s["decode_s"] for s in ok)
    lat = [s["latency_s"] for s in ok]
    return {"requests": len(samples), "errors": len(samples) - len(ok),
            "error_rate": (len(samples) - len(ok)) / len(samples) if samples else None,
            "output_tokens_per_s": sum(s["tokens"] for s in ok) / decode_s if decode_s > 0 else None,
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95)}


def record_row(agg: VersionAgg | None) -> dict[str, Any]:
    if agg is None:
        return {"records": 0, "draft_tokens": 0, "acceptance": None, "acceptance_ci": None,
                "mean_accepted_len": None}
    acc = agg.acceptance
    half = Z95 * math.sqrt(acc.var())
    return {"records": agg.records, "draft_tokens": int(acc.sy), "acceptance": acc.ratio,
            "acceptance_ci": [max(acc.ratio - half, 0.0), min(acc.ratio + half, 1.0)] if acc.n >= 2 else None,
            "mean_accepted_len": agg.length.ratio}


def version_rows(aggs: dict[str, VersionAgg], serving: dict[str, list[dict[str, Any]]],
                 stable: str | None, canary: str | None) -> list[dict[str, Any]]:
    """One row per version that served in the window: stable, canary, then the rest by name."""
    names = set(aggs) | {v for v in serving if v and v != "none"}
    first = [v for v in (stable, canary) if v]
    order = first + sorted(names - set(first))
    rows = []
    for v in order:
        if v not in names and v not in first:
            continue
        role = "stable" if v == stable else "canary" if v == canary else "other"
        rows.append({"version": v, "role": role, **record_row(aggs.get(v)), **serving_row(serving.get(v, []))})
    return rows


def per_position(aggs: dict[str, VersionAgg]) -> dict[str, list[float]]:
    """Accepted at position j over drafting steps (vLLM's accepted_per_pos / num_drafts)."""
    return {v: [n / a.drafting_steps for n in a.accepted_at] if a.drafting_steps else []
            for v, a in aggs.items()}


def acceptance_series(evidence: Sequence[Evidence], t0: float, t1: float, buckets: int) -> dict[str, list]:
    """Per version, [[bucket start, acceptance or None]] over `buckets` equal spans of [t0, t1)."""
    width = max((t1 - t0) / buckets, 1e-9)
    sums: dict[str, list[list[int]]] = {}
    for e in evidence:
        i = int((e.time - t0) // width)
        if 0 <= i < buckets:
            b = sums.setdefault(e.version, [[0, 0] for _ in range(buckets)])[i]
            b[0] += e.sample.accepted
            b[1] += e.sample.judged
    return {v: [[t0 + i * width, a / j if j else None] for i, (a, j) in enumerate(bs)] for v, bs in sums.items()}


def canary_vs_stable(aggs: dict[str, VersionAgg], stable: str, canary: str, rollout: Any, k: int,
                     final: bool) -> dict[str, Any]:
    """Canary minus stable over the controller's window, next to the controller's thresholds
    (rollout: infra.config.RolloutConfig). Each check says pass, fail or pending (the interval
    does not decide it yet), with the same arithmetic as pipeline/rollout/canary_rule.decide."""
    s, c = aggs.get(stable, VersionAgg()), aggs.get(canary, VersionAgg())
    n = {"stable": s.acceptance.n, "canary": c.acceptance.n}
    out: dict[str, Any] = {"stable": stable, "canary": canary, "requests": n, "min_requests": rollout.min_requests,
                           "final_step": final, "alpha": rollout.alpha, "checks": []}
    if min(n.values()) < 2:
        return out
    acc = compare_ratios(s.acceptance, c.acceptance, TAU, rollout.alpha)
    length = compare_ratios(s.length, c.length, TAU, rollout.alpha, scale=float(k))
    out.update(acceptance=acc, mean_accepted_len=length)
    enough = min(n.values()) >= rollout.min_requests
    checks = [("acceptance", "not worse (no rollback)", acc, -rollout.margin),
              ("mean_accepted_len", "not worse (no rollback)", length, -LEN_MARGIN)]
    if final:
        checks.append(("acceptance", "better (promote)", acc, MIN_GAIN))
    for metric, what, cmp, threshold in checks:
        if not enough:
            verdict = "pending"
        elif what.startswith("better"):
            verdict = "pass" if cmp["lower"] > threshold else "pending"
        else:  # rollback fires only when the whole interval is below -margin
            verdict = "fail" if cmp["upper"] < threshold else "pass" if cmp["lower"] > threshold else "pending"
        out["checks"].append({"metric": metric, "check": what, "threshold": threshold, "diff": cmp["diff"],
                              "lower": cmp["lower"], "upper": cmp["upper"], "verdict": verdict})
    return out


DECISIONS = ("start", "advance", "promote", "rollback", "expired", "gated")


def weight_series(audit: Sequence[dict[str, Any]], t0: float, t1: float,
                  current: tuple[float, float] | None = None) -> list[list[float]]:
    """Canary weight as steps [[time, weight]] over [t0, t1], from the audit log: a start or an
    advance sets it, any end of a canary (promote, rollback, expiry) drops it to 0. `current`
    (alias time, weight) wins at the end: a canary set by hand leaves no audit entry."""
    w, points = 0.0, []
    for e in sorted(audit, key=lambda e: e.get("time", 0.0)):
        act, t = e.get("action"), float(e.get("time", 0.0))
        if act in ("start", "advance"):
            new = float(e.get("weight") or 0.0)
        elif act in ("promote", "rollback", "expired"):
            new = 0.0
        else:
            continue
        if t <= t0:
            w = new
        elif t <= t1:
            points.append([t, new])
    last = points[-1][1] if points else w
    if current is not None and abs(current[1] - last) > 1e-9:
        after = points[-1][0] if points else t0  # never before the last audited change
        points.append([min(max(current[0], after), t1), current[1]])
        last = current[1]
    return [[t0, w]] + points + [[t1, last]]


def decision_markers(audit: Sequence[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    return [{"time": float(e["time"]), "action": e.get("action"), "version": e.get("version"),
             "reason": e.get("reason", "")}
            for e in audit if e.get("action") in DECISIONS and t0 <= float(e.get("time", 0.0)) <= t1]


def window_start(audit: Sequence[dict[str, Any]], canary: str | None) -> float | None:
    """Where the controller's current window began: its last start/advance of this canary
    (the controller restarts the window at each), or None without a canary."""
    times = [float(e["time"]) for e in audit if canary and e.get("version") == canary
             and e.get("action") in ("start", "advance")]
    return max(times) if times else None


def batch_series(replicas: Sequence[dict[str, Any]], t0: float) -> dict[str, list[list[float]]]:
    """Requests per target forward over time, per replica (continuous batching: how many
    requests each step carried), from each replica's `batch_series` buckets."""
    out: dict[str, list[list[float]]] = {}
    for r in replicas:
        points = [[t, seqs] for t, seqs, _, _ in r.get("batch_series", []) if t >= t0]
        if points:
            out[f"replica {r.get('replica', '?')}"[:40]] = points
    return out


def by_source(replicas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drafting steps by who proposed (a hybrid's head or suffix, else the draft's family), per
    draft version, summed over the replicas: acceptance and tokens a drafting step emitted."""
    total: dict[tuple[str, str], list[int]] = {}
    for r in replicas:
        for row in r.get("by_source") or ():
            got = total.setdefault((row["draft_version"], row["source"]), [0, 0, 0])
            for i, key in enumerate(("steps", "drafted", "accepted")):
                got[i] += int(row[key])
    return [{"draft_version": v, "source": src, "steps": steps, "drafted": drafted, "accepted": accepted,
             "acceptance": accepted / drafted if drafted else None,
             "tokens_per_step": (accepted + steps) / steps if steps else None}
            for (v, src), (steps, drafted, accepted) in sorted(total.items())]
