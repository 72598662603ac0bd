"""From a checkpoint's weights to a published candidate, on the trainer's rank 0.

Each checkpoint's weights become a candidate draft, scored against the *current* stable version
on held-out records (the paired gate, train/gate/compare.py). How it reaches the registry
depends on train.gate.method:
- "sequential" (the default): the candidate waits (train/gate/pending.py) and is scored again on
  every held-out record that arrives; it is published as soon as the always-valid interval's
  lower bound clears 0, dropped when its upper bound falls below 0, and replaced by the next
  checkpoint's candidate while undecided. The registry gets only candidates the evidence
  favours, minutes after they exist rather than a fixed count of records later.
- "bootstrap": every candidate is published at export with its one-look bootstrap evidence,
  and the controller gates the failing ones.
With no stable version there is nothing to compare with: the candidate is published at once.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Container

import torch

from infra.common.faults import fault_point
from infra.config import OSDConfig
from infra.registry import RegistryError
from train.gate.evaluator import gate_records
from train.gate.pending import Pending


def _log(msg: str) -> None:
    print(f"[osd train rank 0] {msg}", flush=True)


def _with_alpha(metrics: dict[str, Any], scores: list[tuple[float, int]]) -> dict[str, Any]:
    """`metrics` with the candidate's α estimate: its mean acceptance lower bound per position
    over the held-out records the gate scored it on. Taken from the gate's own scores, so the
    estimate costs no pass of its own (a head's pass is an unrolled head over the vocabulary
    at every row); for a layer draft it is train/gate/evaluator.py's estimate_alpha on them."""
    positions = sum(n for _, n in scores)
    return {**metrics, "alpha_est": sum(s for s, _ in scores) / positions if positions else None,
            "alpha_est_records": len(scores)}


class Exporter:
    """Rank 0's candidates: gate, hold back, publish. `parent_version`: the last version published
    (or the init draft's), the lineage parent of the next."""

    def __init__(self, cfg: OSDConfig, fam: Any, target: Any, run_dir: Path, parent_version: str | None):
        self.cfg, self.fam, self.target, self.run_dir = cfg, fam, target, run_dir
        self.parent_version = parent_version
        self.pending: Pending | None = None
        self.counts = {"published": 0, "dropped_worse": 0, "replaced_undecided": 0}
        self._stable: tuple[str, Any, dict[str, tuple[float, int]]] | None = None  # id, model, scores by record

    @property
    def sequential(self) -> bool:
        return self.cfg.train.gate.method == "sequential"

    def export(self, weights: dict[str, torch.Tensor], losses: list[float], n_records: int, *, version: str,
               held_out: list, trained_prompts: Container[bytes], records_total: int,
               world_size: int) -> dict[str, Any] | None:
        """A checkpoint's candidate: published now (its export info returned), or held back (None)."""
        draft = self.fam.rebuild(weights)
        metrics = {"loss": sum(losses) / len(losses) if losses else None, "held_out_records": len(held_out)}
        lineage = {"parent": self.parent_version, "records_consumed": records_total,
                   "records_since_parent": n_records, "world_size": world_size,
                   "zero_stage": self.cfg.train.zero_stage, "family": self.fam.name}
        stable = self._stable_version()
        if not self.sequential or stable is None:
            metrics["gate"], scores = self._bootstrap(draft, held_out, trained_prompts, stable)
            return self._publish(version, draft, _with_alpha(metrics, scores), lineage)
        if self.pending is not None:
            self.counts["replaced_undecided"] += 1
            _log(f"{self.pending.version} is replaced, undecided after {self.pending.looks} looks, by {version}")
        self.pending = Pending(version, (draft, metrics, lineage), time.time())
        return self.look(held_out, trained_prompts)

    def look(self, held_out: list, trained_prompts: Container[bytes]) -> dict[str, Any] | None:
        """Score the waiting candidate on the held-out records it has not seen and judge it again."""
        p = self.pending
        if p is None:
            return None
        draft, metrics, lineage = p.payload
        stable = self._stable_version()
        if stable is None:  # the stable alias went away: nothing to compare with, as at export
            metrics["gate"], scores = self._bootstrap(draft, held_out, trained_prompts, None)
            self.pending = None
            return self._publish(p.version, draft, _with_alpha(metrics, scores), lineage)
        g = self.cfg.train.gate
        first = not p.scores
        pool = gate_records(held_out, g.records, trained_prompts) if first else held_out
        new = p.new_records(pool, lambda r: r.prompt_ids.tobytes() not in trained_prompts)
        if new:
            p.add(new, self.fam.score(draft, new))
        elif not first:
            return None
        if first:
            p.pass_over(held_out)
        records = [r for r in held_out if r.record_id in p.scores]
        try:
            scores = self._stable_scores(stable, records)
        except (RegistryError, OSError) as e:  # the candidate keeps waiting; the next record looks again
            _log(f"cannot score the stable version {stable} ({type(e).__name__}: {e}); {p.version} waits")
            return None
        ev = p.evidence(stable, scores, alpha=1.0 - g.confidence, min_records=g.min_records)
        if ev["verdict"] == "undecided":
            return None
        self.pending = None
        if not ev["passed"]:
            self.counts["dropped_worse"] += 1
            _log(f"{p.version} dropped, not published: {ev['reason']}")
            return None
        metrics["gate"] = ev
        metrics["seconds_to_evidence"] = time.time() - p.created
        return self._publish(p.version, draft, _with_alpha(metrics, list(p.scores.values())), lineage)

    # -- scoring -------------------------------------------------------------------

    def _stable_version(self) -> str | None:
        from infra.registry import Registry

        try:
            return (Registry.from_config(self.cfg).alias("stable") or {}).get("version")
        except (RegistryError, OSError) as e:
            _log(f"cannot read the stable alias ({type(e).__name__}: {e}); judging as if there were none")
            return None

    def _stable_scores(self, stable: str, records: list) -> dict[str, tuple[float, int]]:
        """The stable version's per-record sums, kept by record id while it stays stable."""
        from infra.registry import Registry

        if self._stable is None or self._stable[0] != stable:
            model, _ = Registry.from_config(self.cfg).load_draft(stable, self.target)
            self._stable = (stable, model, {})
        _, model, scores = self._stable
        todo = [r for r in records if r.record_id not in scores]
        if todo:
            scores.update(zip((r.record_id for r in todo), self.fam.score(model, todo)))
        return scores

    def _bootstrap(self, draft: Any, held_out: list, trained_prompts: Container[bytes],
                   stable: str | None) -> tuple[dict[str, Any], list[tuple[float, int]]]:
        """The one-look bootstrap evidence against `stable` on the newest held-out records, and the
        candidate's per-record scores on them (scored with no stable too: its α estimate)."""
        from train.gate.compare import gate

        g = self.cfg.train.gate
        kw = dict(confidence=g.confidence, resamples=g.resamples, min_records=g.min_records, min_gain=0.0)
        records = gate_records(held_out, g.records, trained_prompts)
        cand = self.fam.score(draft, records) if records else []
        if stable is None:
            return gate([], [], [], stable_version=None, **kw), cand
        try:
            scores = self._stable_scores(stable, records)
        except (RegistryError, OSError) as e:
            # No evidence means gated: the candidate is still published, for a person to look at.
            return {"passed": False, "stable": None, "records": len(records),
                    "reason": f"could not score the stable version ({type(e).__name__}: {e})"}, cand
        return gate([c for c, _ in cand], [scores[r.record_id][0] for r in records], [n for _, n in cand],
                    stable_version=stable, **kw), cand

    # -- publishing ----------------------------------------------------------------

    def _publish(self, version: str, draft: Any, metrics: dict, lineage: dict) -> dict[str, Any]:
        """Save the candidate and publish it to the registry, where the controller picks it up. A
        registry that cannot take it costs nothing: the checkpoint is COMPLETE and the candidate
        stays on disk."""
        from infra.drafts.layer import target_ref_of
        from infra.registry import Registry

        out_dir = self.run_dir / "candidates" / version
        self.fam.save(draft, out_dir, target_ref=target_ref_of(self.cfg.model, self.target),
                      lineage=lineage, metrics=metrics)
        path = str(out_dir)
        fault_point("trainer.before_publish")  # checkpointed and acked, the candidate saved, not published
        try:
            reg = Registry.from_config(self.cfg)
            published = reg.publish(out_dir, version, lineage=lineage, metrics=metrics)
            if reg.local:  # digests were computed while copying; no second hashing pass
                path = str(reg.payload_dir(published))
                shutil.rmtree(out_dir, ignore_errors=True)
            # Retention's one owner: whoever adds versions keeps them within it (the controller
            # does not collect; its decisions can lag exports: a long canary, a controller down).
            removed = reg.gc(self.cfg.registry.keep_last)
            if removed:
                _log(f"registry gc removed {', '.join(removed)}")
        except (RegistryError, OSError) as e:
            _log(f"could not publish {version} to the registry ({e}); it stays at {out_dir}")
        gate = metrics["gate"]
        _log(f"published {version}: alpha_est {metrics['alpha_est']}, loss {metrics['loss']}, "
             f"{lineage['records_consumed']} records; gate {'passed' if gate['passed'] else 'failed'}: {gate['reason']}")
        self.parent_version = version
        self.counts["published"] += 1
        return {"version": version, "path": path, **metrics, **lineage}
