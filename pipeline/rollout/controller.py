"""The canary rollout controller: candidate -> canary at rising weights -> promote or roll back.

    registry (versions, aliases) <── CanaryController ──> audit/ + metrics
                                          ^
    record stream ── consumer group "rollout" (evidence: one sample per finished request)

One look (`tick`):
1. Read new records as the `rollout.group` consumer (its own group: the trainers see every
   record too) and turn each into an (acceptance, mean accepted length) sample of the
   version that served it (pipeline/rollout/canary_rule.py). Only samples of the current window
   count: both arms over the same span of traffic.
2. No canary: the registry versions newer than stable that were never decided on, newest
   first, meet the offline gate: a version whose manifest lacks passing paired evidence
   against the *current* stable (train/gate/compare.py, written by the trainer at export) is audited
   `gated` with that evidence and never served. The first one admitted becomes the canary
   at the first weight (alias `canary`), and the window restarts.
3. A canary: `decide()` on the window. advance -> next weight (window restarts); promote
   (only at the last step below full traffic, on evidence of improvement); rollback -> the
   canary alias is dropped; expire (the step's request budget spent undecided) -> dropped
   too, stable stays. Every decision, with the evidence it rested on, goes to the
   registry's audit log and to metrics.

State lives in the registry (aliases + audit), so a restarted controller carries on: the
canary it finds keeps its weight, and versions with a decision in the audit are not tried
again. A rollback or expiry is audited before the canary alias is dropped, so a controller
killed in between cannot forget it (tests/faults/test_controller_kill.py). That includes a person's `osd registry rollback`: the audit is re-read before any new
canary starts, so a version rolled back by hand is not canaried again (a person can still
promote it or make it the canary). Alias moves are compare-and-set (the registry refuses one
if the canary alias changed since this tick read it), so a tick racing a manual rollback
cannot put the canary back. It runs as a Ray actor (`start_controller`) or, for tests, by calling tick() directly.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pipeline.rollout.canary_rule import Arm, CanaryRule, decide, gate_verdict, request_sample
from infra.config import OSDConfig
from infra.common.faults import fault_point
from infra.registry import AliasMoved, Registry, RegistryError

# Decisions after which a version is never canaried again by the controller.
FINAL = ("promote", "rollback", "gated", "expired")


def _log(msg: str) -> None:
    print(f"[osd rollout] {msg}", flush=True)


class CanaryController:
    def __init__(self, cfg: OSDConfig | dict[str, Any], registry: Registry | None = None,
                 consumer_name: str = "controller"):
        from infra.records.streams import RecordConsumer

        self.cfg = cfg = cfg if isinstance(cfg, OSDConfig) else OSDConfig.model_validate(cfg)
        ro = cfg.rollout
        self.rule = CanaryRule(alpha=ro.alpha, margin=ro.margin, min_requests=ro.min_requests,
                               max_requests=ro.max_requests, guard_requests=ro.guard_requests)
        self.steps = list(ro.canary_steps)
        self.registry = registry or Registry.from_config(cfg)
        stream_cfg = cfg.stream.model_copy(update={"group": ro.group})
        self.consumer = RecordConsumer(cfg.stream.redis_url, stream_cfg, name=consumer_name)
        self.decided = self._decided_in_audit()
        self.window_start = time.time()
        self.arms: dict[str, Arm] = {}
        self.history: list[dict[str, Any]] = []  # every sample: (time, version, acceptance, len)
        self.decisions: list[dict[str, Any]] = []
        self.metrics = _Metrics()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.progress_s = 30.0
        self._last_progress = time.monotonic()
        self._count_start(cfg)

    def _count_start(self, cfg: OSDConfig) -> None:
        """Starts of the controller, for the ops page (above 1: it was restarted) and Prometheus."""
        from infra.redis.loop_status import count_start
        from infra.records.streams import connect

        self.metrics.started()
        try:
            client = connect(cfg.stream.redis_url, cfg.stream)
            n = count_start(client, cfg.stream.stream, "controller")
            client.close()
        except Exception as e:  # telemetry only: a controller starts without it
            _log(f"could not count this start in Redis ({type(e).__name__}: {e})")
            return
        if n > 1:
            _log(f"started again (start {n}): the canary and decisions carry on from the registry")

    # -- evidence --------------------------------------------------------------

    def _read(self, budget_s: float = 2.0) -> int:
        """Drain what is in the stream, but for at most budget_s: under a steady flow of records
        the stream is never empty, and an unbounded drain would starve the decisions."""
        n = 0
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            got = self.consumer.read(block_ms=0)
            if not got:
                return n
            for d in got:
                rec = d.record
                sample = request_sample(rec.accepted.tolist(), rec.draft_tokens.tolist())
                if sample is None or rec.draft_version == "none":
                    continue
                self.history.append({"time": rec.created_at, "version": rec.draft_version,
                                     "acceptance": sample.acceptance, "mean_accepted_len": sample.mean_accepted_len,
                                     "accepted": sample.accepted, "judged": sample.judged, "domain": rec.domain})
                del self.history[:-100_000]
                if rec.created_at >= self.window_start:
                    self.arms.setdefault(rec.draft_version, Arm()).add(sample)
                n += 1
            self.consumer.ack(got)
        return n

    def _restart_window(self) -> None:
        self.window_start = time.time()
        self.arms = {}

    # -- decisions -------------------------------------------------------------

    def _record(self, action: str, version: str, reason: str, evidence: dict | None = None, **extra: Any) -> dict:
        entry = {"action": action, "version": version, "reason": reason, "evidence": evidence or {}, **extra}
        entry["audit_path"] = self.registry.audit(entry)
        entry["time"] = time.time()
        self.decisions.append(entry)
        self.metrics.decision(version, action)
        _log(f"{action} {version}: {reason}")
        # No gc here: the trainer, which adds the versions, is registry retention's one owner
        # (train/trainer.py _publish). A decided version waits for the next publish to go, so
        # the registry holds at most keep_last + the protected + one between publishes.
        return entry

    def _decided_in_audit(self) -> set[str]:
        return {e.get("version") for e in self.registry.audit_log() if e.get("action") in FINAL}

    def _candidate(self, stable: dict[str, Any]) -> Any | None:
        """The newest undecided version newer than stable that the offline gate admits; each
        one refused on the way is audited `gated` with its evidence (so never tried again)."""
        try:
            stable_v = self.registry.get(stable["version"])
        except RegistryError:
            return None

        def undecided() -> list:
            return [v for v in self.registry.list() if v.created_at > stable_v.created_at
                    and v.id not in self.decided and v.id != stable_v.id]

        if not undecided():
            return None
        # Others decide too (`osd registry rollback`): re-read the audit only when about to start one.
        self.decided |= self._decided_in_audit()
        for v in reversed(undecided()):
            ok, why = gate_verdict(v.metrics.get("gate"), stable_v.id)
            if ok:
                return v
            self.decided.add(v.id)
            self._record("gated", v.id, why, {"gate": _without_pairs(v.metrics.get("gate"))},
                         stable=stable_v.id, parent=v.lineage.get("parent"), alpha_est=v.metrics.get("alpha_est"))
        return None

    def tick(self) -> list[dict[str, Any]]:
        """One look at the evidence; returns the decisions it made."""
        n_before = len(self.decisions)
        self._read()
        aliases = self.registry.aliases()
        stable, canary = aliases["stable"], aliases["canary"]
        if not stable:
            return []
        s_arm = self.arms.get(stable["version"], Arm())
        self.metrics.arm(stable["version"], "stable", s_arm)
        if canary is None:
            cand = self._candidate(stable)
            if cand is not None:
                try:
                    self.registry.set_canary(cand.id, self.steps[0], reason="new candidate", expect=None)
                except AliasMoved as e:
                    _log(f"not starting {cand.id}: {e}")
                    return []
                fault_point("rollout.after_alias_move")
                self._restart_window()
                self.metrics.weight(cand.id, self.steps[0])
                self._record("start", cand.id, f"new candidate (parent {cand.lineage.get('parent')}, "
                             f"alpha_est {cand.metrics.get('alpha_est')}); canary at {self.steps[0]:.0%}",
                             {"gate": _without_pairs(cand.metrics.get("gate"))},
                             weight=self.steps[0], stable=stable["version"])
            return self.decisions[n_before:]
        version, weight = canary["version"], float(canary["weight"])
        c_arm = self.arms.get(version, Arm())
        self.metrics.arm(version, "canary", c_arm)
        try:
            if weight >= 1.0:  # a restarted controller found the canary at full traffic: finish
                return self._promote(version, stable, {"canary": c_arm.summary()}, n_before)
            nxt = [w for w in self.steps if w > weight]
            d = decide(s_arm, c_arm, self.rule, k=self.cfg.serve.k, final=not nxt or nxt[0] >= 1.0)
            self._progress(version, weight, s_arm, c_arm, d)
            return self._act(d, version, weight, stable, n_before)
        except AliasMoved as e:  # a person moved the canary since this tick read it: theirs stands
            _log(f"canary {version} left as the person set it: {e}")
            self._restart_window()
            return self.decisions[n_before:]

    def _act(self, d: Any, version: str, weight: float, stable: dict[str, Any], n_before: int) -> list:
        if d.action in ("rollback", "expire"):  # either way the canary goes and stable stays
            action = "rollback" if d.action == "rollback" else "expired"
            # The decision is durable before the alias moves (as Registry.rollback does): a
            # controller killed in between finds it in the audit and never canaries it again.
            self.decided.add(version)
            self._record(action, version, d.reason, d.evidence, weight=weight, stable=stable["version"])
            self.registry.clear_canary(expect=version)
            fault_point("rollout.after_alias_move")
            self.metrics.weight(version, 0.0)
            self._restart_window()
        elif d.action == "promote":
            return self._promote(version, stable, d.evidence, n_before, d.reason)
        elif d.action == "advance":
            nxt = [w for w in self.steps if w > weight]
            if not nxt or nxt[0] >= 1.0:  # decide() promotes at the last step; never on non-inferiority
                raise ValueError(f"advance at the last canary step ({weight:.0%}) is not a promotion")
            self.registry.set_canary(version, nxt[0], reason=d.reason, expect=version)
            fault_point("rollout.after_alias_move")
            self.metrics.weight(version, nxt[0])
            self._record("advance", version, d.reason, d.evidence, weight=nxt[0], stable=stable["version"])
            self._restart_window()
        return self.decisions[n_before:]

    def _progress(self, version: str, weight: float, s_arm: Arm, c_arm: Arm, d: Any) -> None:
        """A line every progress_s while a canary waits for evidence (a quiet controller looks hung)."""
        now = time.monotonic()
        if d.action != "continue" or now - self._last_progress < self.progress_s:
            return
        self._last_progress = now
        _log(f"canary {version} at {weight:.0%}: stable n={s_arm.n} acceptance {s_arm.acceptance.ratio:.3f}, "
             f"canary n={c_arm.n} acceptance {c_arm.acceptance.ratio:.3f}; {d.reason}")

    def _promote(self, version: str, stable: dict, evidence: dict, n_before: int, reason: str = "") -> list:
        self.registry.promote(version, reason="canary passed", expect_canary=version)
        fault_point("rollout.after_alias_move")
        self.decided.add(version)
        self.metrics.weight(version, 1.0)
        self._record("promote", version, reason or "canary at full weight", evidence,
                     previous=stable["version"])
        self._restart_window()
        return self.decisions[n_before:]

    # -- running -----------------------------------------------------------------

    def start(self) -> None:
        poll = self.cfg.rollout.poll_s

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.tick()
                except Exception as e:  # Redis or registry hiccup: keep the controller alive
                    self.errors += 1
                    _log(f"tick failed ({type(e).__name__}: {e}); retrying in {poll} s")
                self._stop.wait(poll)

        self._thread = threading.Thread(target=loop, name="osd-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop ticking; status and samples stay readable. A second call does nothing more."""
        stopped = self._stop.is_set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not stopped:
            self.consumer.close()

    def status(self) -> dict[str, Any]:
        return {"aliases": self.registry.aliases(), "decisions": list(self.decisions),
                "arms": {v: a.summary() for v, a in self.arms.items()}, "window_start": self.window_start,
                "errors": self.errors}

    def samples(self) -> list[dict[str, Any]]:
        return list(self.history)


class _Metrics:
    """Rollout metrics labelled by draft version (Ray's Prometheus exporter); no-ops outside Ray."""

    def __init__(self) -> None:
        self.ok = False
        import ray

        if not ray.is_initialized():
            return  # a controller ticked directly (tests): no exporter to report to
        try:
            from ray.util import metrics as m

            self._weight = m.Gauge("osd_rollout_canary_weight", "Canary traffic share", tag_keys=("draft_version",))
            self._decisions = m.Counter("osd_rollout_decisions_total", "Rollout decisions",
                                        tag_keys=("draft_version", "action"))
            self._acc = m.Gauge("osd_rollout_window_acceptance",
                                "Acceptance in the window (accepted over judged draft tokens)",
                                tag_keys=("draft_version", "arm"))
            self._n = m.Gauge("osd_rollout_window_requests", "Requests in the window",
                              tag_keys=("draft_version", "arm"))
            self._starts = m.Counter("osd_rollout_controller_starts_total", "Rollout controller starts")
        except (ImportError, ValueError, TypeError, RuntimeError) as e:
            # Metrics are optional to a rollout: decisions and the audit log go on without them.
            _log(f"rollout metrics off: cannot create them ({type(e).__name__}: {e})")
            return
        self.ok = True

    def weight(self, version: str, w: float) -> None:
        if self.ok:
            self._weight.set(w, {"draft_version": version})

    def started(self) -> None:
        if self.ok:
            self._starts.inc(1)

    def decision(self, version: str, action: str) -> None:
        if self.ok:
            self._decisions.inc(1, {"draft_version": version, "action": action})

    def arm(self, version: str, arm: str, a: Arm) -> None:
        if self.ok:
            self._acc.set(a.acceptance.ratio, {"draft_version": version, "arm": arm})
            self._n.set(a.n, {"draft_version": version, "arm": arm})


def _without_pairs(gate: Any) -> Any:
    """Gate evidence for the audit log, without the per-record pairs (they stay in the manifest)."""
    return {k: v for k, v in gate.items() if k != "per_record"} if isinstance(gate, dict) else gate


CONTROLLER_NAME = "osd-rollout-controller"


def start_controller(cfg: OSDConfig) -> Any:
    """The controller as a named, detached-from-driver Ray actor, ticking in its own thread."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=4)(_ControllerActor)
    handle = actor.options(name=CONTROLLER_NAME, get_if_exists=True).remote(cfg.model_dump(mode="json"))
    ray.get(handle.ready.remote(), timeout=120)
    return handle


class _ControllerActor:
    def __init__(self, cfg_dict: dict[str, Any]):
        self.c = CanaryController(cfg_dict)
        self.c.start()

    def ready(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        return self.c.status()

    def samples(self) -> list[dict[str, Any]]:
        return self.c.samples()

    def stop(self) -> None:
        self.c.stop()
