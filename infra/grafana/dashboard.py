"""The Grafana dashboard, generated from code so its metric names cannot drift from the ones the
platform registers (tests/test_grafana.py checks both, and that every expression parses).

    python -m infra.grafana.dashboard        # rewrites infra/grafana/osd.json and the chart's copy

The PromQL follows the shape of vLLM's spec-decode dashboard: acceptance is a ratio of counter
rates (accepted over draft tokens), mean accepted length is 1 + accepted / drafts, per-position
acceptance divides by the number of drafts. Every query is per `draft_version`; the canary and
stable roles come from the `osd_draft_info` gauge. Ray's exporter prefixes every application
metric with `ray_` (PREFIX).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PREFIX = "ray_"
ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (ROOT / "infra" / "grafana" / "osd.json", ROOT / "helm" / "osd" / "dashboards" / "osd.json")
RATE = "$__rate_interval"
SEL = 'draft_version=~"$version", ray_io_cluster=~"$cluster"'  # per-version series
CLUSTER = 'ray_io_cluster=~"$cluster"'  # series without a version (stream, trainer)


def m(name: str) -> str:
    """A metric name as Ray's Prometheus endpoint exposes it."""
    return PREFIX + name


def _rate(name: str, sel: str = SEL, by: str = "draft_version") -> str:
    return f"sum by ({by}) (rate({m(name)}{{{sel}}}[{RATE}]))"


ACCEPTANCE = f"{_rate('osd_spec_decode_num_accepted_tokens_total')} / {_rate('osd_spec_decode_num_draft_tokens_total')}"


def _role_acceptance(role: str) -> str:
    """One number: the acceptance of the version now in `role` (the info gauge is 1 there)."""
    info = f'max by (draft_version) ({m("osd_draft_info")}{{role="{role}", {CLUSTER}}} == 1)'
    return f"sum(({ACCEPTANCE}) * on (draft_version) group_left {info})"


def panels() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(PromQL, legend)]) per panel, in display order."""
    pos = (f"sum by (draft_version, position) (rate({m('osd_spec_decode_num_accepted_tokens_per_pos_total')}"
           f"{{{SEL}}}[{RATE}])) / on (draft_version) group_left {_rate('osd_spec_decode_num_drafts_total')}")
    share = (f"{_rate('osd_requests_total')} / ignoring (draft_version) group_left "
             f"sum(rate({m('osd_requests_total')}{{{CLUSTER}}}[{RATE}]))")
    p95 = f"histogram_quantile(0.95, {_rate('osd_request_latency_seconds_bucket', by='draft_version, le')})"
    return [
        ("Acceptance rate per version", "percentunit", [(ACCEPTANCE, "{{draft_version}}")]),
        ("Mean accepted length (tokens per step)", "none",
         [(f"1 + {_rate('osd_spec_decode_num_accepted_tokens_total')} / {_rate('osd_spec_decode_num_drafts_total')}",
           "{{draft_version}}")]),
        ("Acceptance per draft position", "percentunit", [(pos, "{{draft_version}} pos {{position}}")]),
        ("Acceptance by who proposed (head+suffix: head / suffix)", "percentunit",
         [(f"{_rate('osd_spec_decode_num_accepted_tokens_by_source_total', by='draft_version, source')} / "
           f"{_rate('osd_spec_decode_num_draft_tokens_by_source_total', by='draft_version, source')}",
           "{{draft_version}} {{source}}")]),
        ("Canary minus stable acceptance", "percentunit",
         [(f"{_role_acceptance('canary')} - {_role_acceptance('stable')}", "canary - stable")]),
        ("Output tokens/s per version", "short", [(_rate("osd_generation_tokens_total"), "{{draft_version}}")]),
        ("p95 request latency per version", "s", [(p95, "{{draft_version}}")]),
        ("Batch: requests and tokens per target forward (mean)", "none",
         [(f"sum(rate({m('osd_batch_size_sum')}{{{CLUSTER}}}[{RATE}])) / "
           f"sum(rate({m('osd_batch_size_count')}{{{CLUSTER}}}[{RATE}]))", "requests per forward"),
          (f"sum(rate({m('osd_batch_tokens_sum')}{{{CLUSTER}}}[{RATE}])) / "
           f"sum(rate({m('osd_batch_tokens_count')}{{{CLUSTER}}}[{RATE}]))", "tokens per forward")]),
        ("Batched steps: tokens/s where they may draft and where they may not (draft gate)", "short",
         [(f"max by (kind, batch) ({m('osd_draft_gate_tokens_per_second')}{{{CLUSTER}}})",
           "{{kind}}, {{batch}}+ requests")]),
        ("Batched steps: drafting over plain, adjacent blocks (draft gate; below 1 holds drafting back)", "none",
         [(f"max by (batch) ({m('osd_draft_gate_drafting_vs_plain')}{{{CLUSTER}}})", "{{batch}}+ requests")]),
        ("Prompt tokens a KV slot already held (prefix reuse)", "percentunit",
         [(f"sum(rate({m('osd_prompt_cached_tokens_total')}{{{CLUSTER}}}[{RATE}])) / "
           f"sum(rate({m('osd_prompt_tokens_total')}{{{CLUSTER}}}[{RATE}]))", "share of prompt tokens")]),
        ("Canary weight (controller)", "percentunit",
         [(f"max by (draft_version) ({m('osd_rollout_canary_weight')}{{{SEL}}})", "{{draft_version}}")]),
        ("Actual traffic share per version", "percentunit", [(share, "{{draft_version}}")]),
        ("Rollout decisions", "short",
         [(f"sum by (draft_version, action) (increase({m('osd_rollout_decisions_total')}{{{SEL}}}[{RATE}]))",
           "{{action}} {{draft_version}}")]),
        ("Records written vs dropped", "short",
         [(f"sum(rate({m('osd_records_written_total')}{{{CLUSTER}}}[{RATE}]))", "written"),
          (_rate("osd_records_dropped_total", CLUSTER, "reason"), "dropped: {{reason}}")]),
        ("Stream length and group lag", "short",
         [(f"max by (group) ({m('osd_stream_group_lag')}{{{CLUSTER}}})", "lag {{group}}"),
          (f"max by (group) ({m('osd_stream_group_pending')}{{{CLUSTER}}})", "pending {{group}}"),
          (f"max({m('osd_stream_length')}{{{CLUSTER}}})", "stream length")]),
        ("Trainer loss", "none", [(f"avg by (rank) ({m('osd_trainer_loss')}{{{CLUSTER}}})", "rank {{rank}}")]),
        ("Trainer steps/s and exports", "short",
         [(f"sum(rate({m('osd_trainer_steps_total')}{{{CLUSTER}}}[{RATE}]))", "steps/s"),
          (f"sum(increase({m('osd_trainer_exports_total')}{{{CLUSTER}}}[{RATE}]))", "exports")]),
        ("Restarts: trainer (resumed a checkpoint) and rollout controller", "short",
         [(f"sum(increase({m('osd_trainer_restarts_total')}{{{CLUSTER}}}[{RATE}]))", "trainer restarts"),
          (f"sum(increase({m('osd_rollout_controller_starts_total')}{{{CLUSTER}}}[{RATE}]))", "controller starts")]),
        ("Time to adapt: minutes from the last domain shift to a promotion (or waited so far)", "m",
         [(f"max by (state) ({m('osd_adapt_minutes')}{{{CLUSTER}}})", "{{state}}")]),
        ("Gain of the first promotion after the last shift (acceptance)", "none",
         [(f"max({m('osd_adapt_gain')}{{{CLUSTER}}})", "acceptance gain"),
          (f"time() - max({m('osd_adapt_last_shift_timestamp_seconds')}{{{CLUSTER}}})", "seconds since the shift")]),
    ]


def _panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {"id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(targets)]}


def _var(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "query": {"query": query, "refId": name},
            "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict:
    return {
        "uid": "osd-spec-decode", "title": "osd: draft versions, rollout and the training loop",
        "tags": ["osd", "speculative-decoding"], "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _var("cluster", "Cluster", f"label_values({m('osd_requests_total')}, ray_io_cluster)"),
            _var("version", "Draft version", f"label_values({m('osd_requests_total')}, draft_version)"),
        ]},
        "panels": [_panel(i, *p) for i, p in enumerate(panels())],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    for path in OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
