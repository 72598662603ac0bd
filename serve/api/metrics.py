"""Serving metrics, every one tagged with the draft version that served the request.

The spec-decode counters keep the meanings of vLLM's:
- num_drafts: steps in which the draft proposed at least one token;
- num_draft_tokens: draft tokens proposed;
- num_accepted_tokens: draft tokens the target accepted;
- num_accepted_tokens_per_pos: accepted tokens by position within the step (tag `position`).
Exported through ray.serve.metrics, so they reach Ray's Prometheus endpoint with the
deployment and replica tags Serve adds.
"""

from __future__ import annotations

import collections
import time
from typing import Any

LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64]
TPOT_BOUNDARIES = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
BATCH_BOUNDARIES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
ROWS_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]


class ServeMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics as m

        tag = ("draft_version",)
        self.requests = m.Counter("osd_requests_total", "Requests finished", tag_keys=tag)
        self.errors = m.Counter("osd_request_errors_total", "Requests failed, by reason",
                                tag_keys=("draft_version", "reason"))
        self.tokens = m.Counter("osd_generation_tokens_total", "Tokens generated", tag_keys=tag)
        self.prompt_tokens = m.Counter("osd_prompt_tokens_total", "Prompt tokens of finished requests", tag_keys=tag)
        # vLLM's prefix cache hits: prompt tokens whose keys and values a slot already held.
        self.cached_tokens = m.Counter("osd_prompt_cached_tokens_total",
                                       "Prompt tokens taken from a KV slot instead of computed", tag_keys=tag)
        self.drafts = m.Counter("osd_spec_decode_num_drafts_total", "Steps with at least one draft token",
                                tag_keys=tag)
        self.draft_tokens = m.Counter("osd_spec_decode_num_draft_tokens_total", "Draft tokens proposed",
                                      tag_keys=tag)
        self.accepted = m.Counter("osd_spec_decode_num_accepted_tokens_total", "Draft tokens accepted",
                                  tag_keys=tag)
        self.accepted_per_pos = m.Counter("osd_spec_decode_num_accepted_tokens_per_pos_total",
                                          "Draft tokens accepted, by position in the step",
                                          tag_keys=("draft_version", "position"))
        self.latency = m.Histogram("osd_request_latency_seconds", "End-to-end request latency",
                                   boundaries=LATENCY_BOUNDARIES, tag_keys=tag)
        self.tpot = m.Histogram("osd_time_per_output_token_seconds", "Decode seconds per output token",
                                boundaries=TPOT_BOUNDARIES, tag_keys=tag)
        self.records_written = m.Counter("osd_records_written_total", "Training records written to the stream",
                                         tag_keys=tag)
        self.records_dropped = m.Counter("osd_records_dropped_total", "Training records dropped, by reason",
                                         tag_keys=("draft_version", "reason"))
        self.records_replayed = m.Counter("osd_records_replayed_total",
                                          "Training records a killed replica left in its spool, written by this one",
                                          tag_keys=tag)
        # 1 for the version in each role now, 0 for one that left it (Grafana joins on it).
        self.draft_info = m.Gauge("osd_draft_info", "Draft version serving in each role (1 = now)",
                                  tag_keys=("draft_version", "role"))
        # Continuous batching: per target forward, the requests it carried and its rows (tokens:
        # decode rows, verify blocks, prompt chunks). Not by draft version: a forward mixes them.
        self.batch_size = m.Histogram("osd_batch_size", "Requests per target forward",
                                      boundaries=BATCH_BOUNDARIES)
        self.batch_rows = m.Histogram("osd_batch_tokens", "Tokens (rows) per target forward",
                                      boundaries=ROWS_BOUNDARIES)
        # Who proposed (head+suffix: "head" or "suffix"; else the draft's family), per version.
        by_source = ("draft_version", "source")
        self.source_drafts = m.Counter("osd_spec_decode_num_drafts_by_source_total",
                                       "Steps with at least one draft token, by who proposed", tag_keys=by_source)
        self.source_draft_tokens = m.Counter("osd_spec_decode_num_draft_tokens_by_source_total",
                                             "Draft tokens proposed, by who proposed", tag_keys=by_source)
        self.source_accepted = m.Counter("osd_spec_decode_num_accepted_tokens_by_source_total",
                                         "Draft tokens accepted, by who proposed", tag_keys=by_source)
        # The suffix draft's replica index (serve/spec_decode/suffix/draft.py).
        self.suffix_tokens = m.Gauge("osd_suffix_index_tokens", "Tokens in the replica's suffix index")
        self.suffix_bytes = m.Gauge("osd_suffix_index_bytes", "Bytes the replica's suffix index holds")
        self.suffix_hit = m.Gauge("osd_suffix_proposal_rate", "Share of suffix lookups that proposed a chain")
        self.gate_rate = m.Gauge("osd_draft_gate_tokens_per_second",
                                 "Tokens per second of batched steps that may draft and of steps that may not, "
                                 "by batch size (the cost rule's gate, serve/spec_decode/draft_gate.py)",
                                 tag_keys=("kind", "batch"))
        self.gate_ratio = m.Gauge("osd_draft_gate_drafting_vs_plain",
                                  "The gate's paired estimate of drafting steps' tokens per second over plain steps', "
                                  "by batch size (adjacent blocks compared; below 1: drafting held back)",
                                  tag_keys=("batch",))
        self._seen_steps = 0
        self._roles: dict[str, str | None] = {"stable": None, "canary": None}
        self._seen_written = 0
        self._seen_replayed = 0
        self._seen_dropped: dict[str, int] = {}
        self.recent = RecentRequests()
        # (draft version, source) -> [drafting steps, draft tokens, accepted]: the replica's
        # totals for /osd/stats and the ops page (the counters above are for Prometheus).
        self.by_source: dict[tuple[str, str], list[int]] = {}

    def observe(self, version: str, result: Any, latency_s: float) -> None:
        """result: serve.engine.core.GenerationResult."""
        tags = {"draft_version": version}
        st = result.stats
        self.requests.inc(1, tags)
        self.prompt_tokens.inc(len(result.prompt_ids), tags)
        if result.cached_tokens:
            self.cached_tokens.inc(result.cached_tokens, tags)
        if result.output_ids:
            self.tokens.inc(len(result.output_ids), tags)
            self.tpot.observe(result.decode_s / len(result.output_ids), tags)
        if st.num_drafts:
            self.drafts.inc(st.num_drafts, tags)
            self.draft_tokens.inc(st.num_draft_tokens, tags)
        if st.num_accepted_tokens:
            self.accepted.inc(st.num_accepted_tokens, tags)
        for pos, n in enumerate(st.accepted_per_pos):
            if n:
                self.accepted_per_pos.inc(n, {"draft_version": version, "position": str(pos)})
        for source, (steps, drafted, accepted) in st.by_source.items():
            src = {"draft_version": version, "source": source}
            mine = self.by_source.setdefault((version, source), [0, 0, 0])
            for i, n in enumerate((steps, drafted, accepted)):
                mine[i] += n
            self.source_drafts.inc(steps, src)
            self.source_draft_tokens.inc(drafted, src)
            if accepted:
                self.source_accepted.inc(accepted, src)
        self.latency.observe(latency_s, tags)
        self.recent.add(version, latency_s, len(result.output_ids or ()), result.decode_s, None)

    def sync_steps(self, log: Any) -> None:
        """Fold the engine's new target forwards (serve/engine/scheduler.py StepLog) into the histograms
        (the engine logs them on its own thread)."""
        for _, seqs, rows in log.since(self._seen_steps):
            self.batch_size.observe(seqs)
            self.batch_rows.observe(rows)
        self._seen_steps = log.total

    def source_table(self) -> list[dict[str, Any]]:
        return [{"draft_version": v, "source": src, "steps": a, "drafted": b, "accepted": c}
                for (v, src), (a, b, c) in sorted(self.by_source.items())]

    def sync_suffix(self, stats: dict[str, Any] | None) -> None:
        """The replica's suffix index (SuffixDraft.stats()), when it serves one."""
        if stats:
            self.suffix_tokens.set(stats["global_tokens"])
            self.suffix_bytes.set(stats["global_bytes"])
            self.suffix_hit.set(stats["proposal_rate"])

    def sync_gate(self, state: dict[str, dict[str, float]]) -> None:
        """The engine's gate on batched drafting (SpecEngine.gate_state()): each batch size's two rates
        and its paired estimate, once it has one."""
        for batch, st in state.items():
            self.gate_rate.set(st["drafting_tok_s"], {"kind": "drafting", "batch": batch})
            self.gate_rate.set(st["plain_tok_s"], {"kind": "plain", "batch": batch})
            if st.get("drafting_vs_plain") is not None:
                self.gate_ratio.set(st["drafting_vs_plain"], {"batch": batch})

    def error(self, version: str, reason: str) -> None:
        self.errors.inc(1, {"draft_version": version, "reason": reason})
        self.recent.add(version, 0.0, 0, 0.0, reason)

    def roles(self, stable: str | None, canary: str | None) -> None:
        """Set osd_draft_info when the routing changed (cheap to call on every request)."""
        for role, version in (("stable", stable), ("canary", canary)):
            old = self._roles[role]
            if old == version:
                continue
            if old:
                self.draft_info.set(0, {"draft_version": old, "role": role})
            if version:
                self.draft_info.set(1, {"draft_version": version, "role": role})
            self._roles[role] = version

    def sync_records(self, version: str, written: int, dropped: dict[str, int], replayed: int = 0) -> None:
        """Fold the producer's running totals into the counters (it counts in its own thread)."""
        tags = {"draft_version": version}
        if replayed > self._seen_replayed:
            self.records_replayed.inc(replayed - self._seen_replayed, tags)
            self._seen_replayed = replayed
        if written > self._seen_written:
            self.records_written.inc(written - self._seen_written, tags)
            self._seen_written = written
        for reason, n in dropped.items():
            seen = self._seen_dropped.get(reason, 0)
            if n > seen:
                self.records_dropped.inc(n - seen, {"draft_version": version, "reason": reason})
                self._seen_dropped[reason] = n


class RecentRequests:
    """This replica's last requests, for the ops page's latency percentiles, tokens/s and error
    rates per version (Prometheus histograms cannot be read back in-process). Bounded both by
    count and by age; the ingress merges the replicas' snapshots."""

    def __init__(self, maxlen: int = 2000, max_age_s: float = 3600.0):
        self.items: collections.deque = collections.deque(maxlen=maxlen)
        self.max_age_s = max_age_s

    def add(self, version: str, latency_s: float, tokens: int, decode_s: float, error: str | None) -> None:
        self.items.append((time.time(), version, latency_s, tokens, decode_s, error))

    def snapshot(self) -> list[dict[str, Any]]:
        cutoff = time.time() - self.max_age_s
        return [{"time": t, "version": v, "latency_s": lat, "tokens": n, "decode_s": d, "error": e}
                for t, v, lat, n, d, e in list(self.items) if t >= cutoff]


class StreamMetrics:
    """The record stream's length and each consumer group's lag and pending count, set by the
    ingress's poller (serve/api/ops/source.py `StreamPoller`): is training keeping up, is anything stuck."""

    def __init__(self) -> None:
        from ray.serve import metrics as m

        self.length = m.Gauge("osd_stream_length", "Entries in the record stream", tag_keys=("stream",))
        self.lag = m.Gauge("osd_stream_group_lag", "Entries not yet delivered to the group",
                           tag_keys=("stream", "group"))
        self.pending = m.Gauge("osd_stream_group_pending", "Entries delivered to the group and not acked",
                               tag_keys=("stream", "group"))

        self.shift_time = m.Gauge("osd_adapt_last_shift_timestamp_seconds",
                                  "When the traffic's domain mix last shifted (serve/api/ops/adapt.py)")
        self.adapt_minutes = m.Gauge("osd_adapt_minutes", "Minutes from the last shift to the first promotion "
                                     "after it, or waited so far", tag_keys=("state",))
        self.adapt_gain = m.Gauge("osd_adapt_gain", "Acceptance of the first version promoted after the last "
                                  "shift minus that of the version it replaced, on post-shift records")

    def set_adapt(self, a: dict[str, Any] | None) -> None:
        if a is None:
            return
        self.shift_time.set(a["shift"]["time"])
        promoted = a["minutes"] is not None
        self.adapt_minutes.set(a["minutes"] if promoted else a["waiting_min"],
                               {"state": "promoted" if promoted else "waiting"})
        if a["gain"] is not None:
            self.adapt_gain.set(a["gain"])

    def set(self, stream: str, length: int, groups: list[dict[str, Any]]) -> None:
        self.length.set(length, {"stream": stream})
        for g in groups:
            tags = {"stream": stream, "group": g["group"]}
            if g["lag"] is not None:
                self.lag.set(g["lag"], tags)
            if g["pending"] is not None:
                self.pending.set(g["pending"], tags)
