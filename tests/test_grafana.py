"""The Grafana dashboard (infra/grafana/dashboard.py): the checked-in JSON is the generated one,
every PromQL expression parses, and every metric it names is one the platform registers, under
the name Ray's Prometheus endpoint actually exposes (checked on a live Ray endpoint)."""

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from infra.grafana import dashboard as gd

ROOT = Path(__file__).resolve().parent.parent
# Every module that registers application metrics.
SOURCES = ("serve/api/metrics.py", "train/online/metrics.py", "pipeline/rollout/controller.py")
_DECL = re.compile(r"\.(Counter|Gauge|Histogram)\(\s*\"(osd_[a-z0-9_]+)\"")


def declared() -> dict[str, str]:
    """{metric name as registered: kind}, read from the sources."""
    out = {}
    for src in SOURCES:
        for kind, name in _DECL.findall((ROOT / src).read_text()):
            out[name] = kind
    return out


def exposed_names(decl: dict[str, str]) -> set[str]:
    """What Prometheus sees: Ray's `ray_` prefix, a histogram's _bucket/_sum/_count series."""
    out = set()
    for name, kind in decl.items():
        base = gd.PREFIX + name
        out |= {base + s for s in ("_bucket", "_sum", "_count")} if kind == "Histogram" else {base}
    return out


def _grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$version", ".*").replace("$cluster", ".*")


def metric_names(node) -> set[str]:
    """Metric names in a parsed PromQL tree (promql_parser's node classes)."""
    import promql_parser as pp

    if isinstance(node, pp.VectorSelector):
        return {node.name}
    if isinstance(node, list):
        return set().union(*(metric_names(n) for n in node)) if node else set()
    out = set()
    for attr in ("lhs", "rhs", "expr", "args", "vector_selector", "param"):
        child = getattr(node, attr, None)
        if child is not None:
            out |= metric_names(child)
    return out


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p["targets"]] + [
        v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]


@pytest.mark.pure
def test_checked_in_json_is_the_generated_one():
    for path in gd.OUTPUTS:  # infra/grafana/osd.json and the Helm chart's copy
        assert path.read_text() == gd.render(), f"{path} is stale: run python -m infra.grafana.dashboard"


@pytest.mark.pure
def test_panels_and_variables():
    dash = gd.dashboard()
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for want in ("acceptance rate", "mean accepted length", "per draft position", "canary minus stable",
                 "tokens/s", "p95", "canary weight", "traffic share", "rollout decisions", "dropped",
                 "lag", "trainer loss", "restarts", "time to adapt"):
        assert want in titles, want
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "cluster", "version"}
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 12


@pytest.mark.pure
def test_every_expression_parses_and_names_only_registered_metrics():
    import promql_parser

    known = exposed_names(declared())
    assert "ray_osd_draft_info" in known and "ray_osd_stream_group_lag" in known
    used: set[str] = set()
    for expr in exprs(gd.dashboard()):
        if expr.startswith("label_values("):  # Grafana's own function; its metric is the first argument
            used.add(expr[len("label_values("):].split(",")[0].strip())
            continue
        used |= metric_names(promql_parser.parse(_grafana_to_promql(expr)))
    assert used and used <= known, used - known
    # Every panel's version filter uses the label the serving metrics carry.
    assert all("draft_version" in e for e in exprs(gd.dashboard()) if "spec_decode" in e)


def _scrape(port: int, want: set[str], timeout: float = 60.0, again=None) -> set[str]:
    """The ray_osd_ names on the endpoint once `want` are all there, or at the deadline.
    again(): record the values once more while waiting (Ray's export sometimes drops a first
    report's series, and a metric shows only after a value lands in a later report)."""
    deadline = time.monotonic() + timeout
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        names = {line.split("{")[0].split(" ")[0] for line in body.splitlines()
                 if line.startswith("ray_osd_")}
        if want <= names or time.monotonic() > deadline:
            return names
        if again is not None:
            again()
        time.sleep(1.0)


class _Emitter:
    """Creates every metric class of the platform in one Ray worker and records a value on each."""

    def emit(self) -> bool:
        from types import SimpleNamespace

        from pipeline.rollout.controller import _Metrics
        from pipeline.rollout.canary_rule import Arm
        from serve.api.metrics import ServeMetrics, StreamMetrics
        from train.online.metrics import TrainerMetrics

        sm = ServeMetrics()
        stats = SimpleNamespace(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2, accepted_per_pos=[1, 1],
                                by_source={"suffix": [1, 3, 2]})
        sm.observe("v1", SimpleNamespace(stats=stats, prompt_ids=[5, 6], cached_tokens=1, output_ids=[1, 2, 3],
                                          decode_s=0.1), 0.2)
        # The replica's running totals by source, for /osd/stats and the ops page.
        assert sm.source_table() == [{"draft_version": "v1", "source": "suffix", "steps": 1, "drafted": 3,
                                      "accepted": 2}]
        sm.sync_suffix({"global_tokens": 10, "global_bytes": 300, "proposal_rate": 0.5})
        sm.sync_gate({"8": {"drafting_tok_s": 300.0, "plain_tok_s": 320.0, "drafting_steps": 4, "plain_steps": 4,
                            "drafting_vs_plain": 0.94, "pairs": 9},
                      "2": {"drafting_tok_s": 0.0, "plain_tok_s": 0.0, "drafting_steps": 1, "plain_steps": 0,
                            "drafting_vs_plain": None, "pairs": 0}})
        sm.error("v1", "internal")
        sm.sync_records("v1", 2, {"queue_full": 1}, replayed=1)
        sm.roles("v1", "v2")
        from serve.engine.scheduler import StepLog

        log = StepLog()
        log.add(3, 7)
        sm.sync_steps(log)
        stream = StreamMetrics()
        stream.set("s", 5, [{"group": "trainers", "lag": 3, "pending": 1}])
        stream.set_adapt({"shift": {"time": 1.0e9}, "minutes": 4.0, "waiting_min": None, "gain": 0.1})
        tm = TrainerMetrics(0)
        tm.step(1.0, 4)
        tm.checkpoint("t", {"version": "v2"})
        tm.started(resumed=True)
        rm = _Metrics()
        rm.started()
        rm.weight("v2", 0.1)
        rm.decision("v2", "start")
        rm.arm("v1", "stable", Arm())
        self.keep = (sm, tm, rm, stream)  # metrics live as long as their objects
        return rm.ok


@pytest.mark.ray
def test_registered_names_are_what_rays_endpoint_exposes():
    import sys

    import ray
    from ray import cloudpickle

    from infra.redis.server import free_port

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/

    port = free_port()
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = "500"  # seconds to the endpoint, not ten
    ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=port, log_to_driver=False)
    try:
        emitter = ray.remote(num_cpus=0)(_Emitter).remote()
        assert ray.get(emitter.emit.remote(), timeout=120)
        want = exposed_names(declared())
        got = _scrape(port, want, again=lambda: ray.get(emitter.emit.remote(), timeout=120))
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = saved
    assert want <= got, sorted(want - got)
    assert not any(n.startswith("ray_ray_") or n.endswith("_total_total") for n in got)
