"""Trainer telemetry: Prometheus gauges and counters on Ray's endpoint, and the same numbers in
the loop's status hash in Redis (infra/redis/loop_status.py) for the ops page.

Telemetry never stops training: a Redis write that fails is dropped, and outside Ray
(unit use) only the status hash is kept.
"""

from __future__ import annotations

import time
from typing import Any

from infra.redis.loop_status import count_start, publish


class TrainerMetrics:
    def __init__(self, rank: int, redis_client: Any = None, stream: str = "", publish_every_s: float = 2.0):
        self.rank = rank
        self.client, self.stream = redis_client, stream
        self.publish_every_s = publish_every_s
        self.status: dict[str, Any] = {"rank": rank, "step": 0, "loss": None, "records": 0, "exports": 0,
                                       "last_checkpoint": None, "last_checkpoint_time": None, "last_export": None}
        self._last_publish = 0.0
        self._m = self._make()

    @staticmethod
    def _make() -> dict[str, Any] | None:
        import ray

        if not ray.is_initialized():
            return None
        from ray.util import metrics as m

        tag = ("rank",)
        return {"loss": m.Gauge("osd_trainer_loss", "Distillation loss of the last step", tag_keys=tag),
                "steps": m.Counter("osd_trainer_steps_total", "Optimizer steps", tag_keys=tag),
                "records": m.Counter("osd_trainer_records_consumed_total", "Records trained on", tag_keys=tag),
                "exports": m.Counter("osd_trainer_exports_total", "Draft versions exported", tag_keys=tag),
                "restarts": m.Counter("osd_trainer_restarts_total", "Trainer starts that resumed a checkpoint",
                                      tag_keys=tag)}

    def step(self, loss: float, records_total: int) -> None:
        """records_total: the trainer's running count of records consumed (all ranks, resumes included)."""
        st = self.status
        new_records = max(int(records_total) - st["records"], 0)
        st.update(step=st["step"] + 1, loss=float(loss), records=int(records_total))
        if self._m is not None:
            tags = {"rank": str(self.rank)}
            self._m["loss"].set(float(loss), tags)
            self._m["steps"].inc(1, tags)
            if new_records:
                self._m["records"].inc(new_records, tags)
        if time.time() - self._last_publish >= self.publish_every_s:
            self._publish()

    def started(self, resumed: bool) -> None:
        """Counts this rank's start in Redis (the ops page's restarts) and, when it resumed a
        checkpoint, in osd_trainer_restarts_total."""
        if resumed and self._m is not None:
            self._m["restarts"].inc(1, {"rank": str(self.rank)})
        if self.client is None:
            return
        try:
            count_start(self.client, self.stream, f"trainer-{self.rank}")
        except Exception:  # telemetry is best effort, as in _publish
            pass

    def checkpoint(self, tag: str, export: dict[str, Any] | None) -> None:
        self.status.update(last_checkpoint=tag, last_checkpoint_time=time.time())
        if export:
            self.exported(export)  # publishes the status, this checkpoint's fields with it
        else:
            self._publish()

    def exported(self, export: dict[str, Any]) -> None:
        """A candidate published to the registry (at its checkpoint, or later on its evidence)."""
        self.status["exports"] += 1
        self.status["last_export"] = {k: export.get(k) for k in ("version", "alpha_est", "loss", "records_consumed",
                                                                 "seconds_to_evidence")}
        if self._m is not None:
            self._m["exports"].inc(1, {"rank": str(self.rank)})
        self._publish()

    def candidates(self, exporter: Any) -> None:
        """The candidate waiting for evidence, and how many were dropped or replaced undecided."""
        p = exporter.pending
        self.status["pending"] = None if p is None else {"version": p.version, "records": len(p.scores),
                                                         "looks": p.looks}
        self.status.update({f"candidates_{k}": v for k, v in exporter.counts.items()})

    def _publish(self) -> None:
        self._last_publish = time.time()
        if self.client is None:
            return
        try:
            publish(self.client, self.stream, f"trainer-{self.rank}", self.status)
        except Exception:  # telemetry is best effort: Redis trouble must not stop a step
            pass
