"""Trainer actors on Ray that distill the draft from the record stream.

Why our own actor group and not Ray Train's TorchTrainer: each worker must also be a named
consumer in the stream's consumer group and ack records only after the checkpoint that
covers them, and the group must be restartable from our own COMPLETE-marked checkpoints.
A small group object (placement group, rank 0 first for the rendezvous address, async
methods returning refs) does that in a page, and keeps DeepSpeed inside DistillEngine.

Each step every rank packs its own records to the token budget; one all-reduce decides
whether all ranks have data (otherwise nobody steps and the records wait), whether it is
time to export, and whether to stop, so the collectives never go out of step.

Delivery: a record is acked only after the checkpoint that includes the step that used
it is COMPLETE. A worker killed before that leaves its records pending; the restarted
group takes them over with XAUTOCLAIM and trains on them again: at least once, none lost.
The checkpoint lists the stream ids it covers, and a group resuming from it acks those
first, so a kill between COMPLETE and the XACK does not train them twice.
A live worker touches the records it holds (keep_alive) so they are never taken over early.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from infra.config import OSDConfig
from infra.common.faults import fault_point
from infra.records.streams import READ_COUNT  # records per read with one rank
from train.online.served import ServedFactory
# pipeline/ (traffic/demo, bench/train) imports estimate_alpha and is_held_out from here.
from train.gate.evaluator import estimate_alpha, is_held_out  # noqa: F401

# Prompts trained on, remembered so the gate skips held-out records that repeat one (bounded).
TRAINED_PROMPTS_KEPT = 50_000
HELD_OUT_BUFFER = 200  # newest held-out records kept for the estimate and the gate
REPLAY_BUFFER = 256  # the last trained records replay steps draw from (train.replay_steps)
FILL_BUDGET_S = 2.0  # the longest one fill reads on through records it cannot train on
BUFFER_BATCHES = 4  # the most a buffer holds, in token budgets; older records beyond are skipped
LOOK_EVERY_S = 5.0  # the waiting candidate is judged again at most this often (new held-out records batched)


def _log(rank: int, msg: str) -> None:
    print(f"[osd train rank {rank}] {msg}", flush=True)


@dataclass
class RunStats:
    rank: int
    steps: int = 0
    records_trained: int = 0
    records_acked: int = 0
    tokens: int = 0
    train_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    exports: list[dict[str, Any]] = field(default_factory=list)
    resumed: dict[str, Any] | None = None
    dead_lettered: int = 0
    records_skipped_stale: int = 0  # older than train.max_lag_s when read (train/online/lag.py)
    replay_steps: int = 0  # of `steps`, those on replayed records


class TrainerWorker:
    """One rank: a consumer in the group, a DistillEngine, and (rank 0) the exporter."""

    def __init__(self, cfg_dict: dict[str, Any], rank: int, world_size: int, run_dir: str,
                 init_draft: str | None = None, consumer_name: str | None = None, family: str | None = None,
                 served: ServedFactory | None = None):
        self.cfg = OSDConfig.model_validate(cfg_dict)
        self.rank, self.world_size = rank, world_size
        self.run_dir = Path(run_dir)
        self.init_draft = init_draft
        # The family to train ("layer" or "head"); None: the init draft's (layer without one).
        self.family = family
        self.served = served  # builds a head's served-format forward (train/online/served.py)
        self.consumer_name = consumer_name or f"trainer-{rank}"
        # Deliveries of held-out records: never trained on, acked with the next checkpoint.
        self._held_acks: list = []
        self._held_new = False  # a held-out record arrived since the waiting candidate was last judged
        self._last_look = 0.0
        self.skipped_stale = 0  # records past train.max_lag_s, skipped (train/online/lag.py)
        torch.set_num_threads(1 if world_size > 1 else max(1, torch.get_num_threads()))

    def address(self) -> tuple[str, int]:
        from infra.redis.server import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any] | None:
        from infra.records.streams import RecordConsumer
        from infra.target import load_target
        from train.distill.ds_engine import DistillEngine, init_distributed
        from train.online.family import NO_HEAD_INIT, family_for

        tc = self.cfg.train
        if self.family == "head" and not self.init_draft:
            raise ValueError(NO_HEAD_INIT)
        loaded = load_target(self.cfg.model.target, self.cfg.model.for_training(), progress=False)
        self.target = loaded.model
        draft = self._init_draft()
        # Before the rendezvous: a draft of the wrong family, or a setting it cannot train with,
        # fails every rank here, not in a collective.
        self.fam = family_for(draft, self.target, tc, self.spec_info, self._served_forward(draft))
        if self.family and self.family != self.fam.name:
            raise ValueError(f"asked to train a {self.family} draft; the init draft {self.init_draft} "
                             f"is a {self.fam.name} draft")
        init_distributed(self.rank, self.world_size, master_addr, master_port, tc.device, tc.collective_timeout_s)
        self.engine = DistillEngine(draft, tc, autocast=self.fam.autocast)
        from infra.drafts.layer import target_ref_of

        # Records of other target weights (schema v2's target_sha256) are dead-lettered, never trained on.
        self.consumer = RecordConsumer(self.cfg.stream.redis_url, self.cfg.stream, name=self.consumer_name,
                                       expect_target_sha256=target_ref_of(self.cfg.model, self.target)["sha256"])
        from infra.records.streams import connect
        from train.online.metrics import TrainerMetrics

        # Loss, steps and checkpoints for Prometheus and the ops page (its own client: never the consumer's).
        self.telemetry = TrainerMetrics(self.rank, connect(self.cfg.stream.redis_url, self.cfg.stream, role="trainer"),
                                        self.cfg.stream.stream)
        self.held_out: list[Any] = []
        self.trained_prompts: dict[bytes, None] = {}  # insertion-ordered set, oldest dropped first
        self.replay: list[Any] = []  # recently trained records (train.replay_steps); not persisted
        self._rng = random.Random(self.rank)
        resumed = self.engine.load_latest(self.ckpt_dir)
        self.records_total = int(resumed["records_total"]) if resumed else 0
        self.versions = int(resumed.get("versions", 0)) if resumed else 0
        if resumed and resumed.get("parent_version"):
            self.parent_version = resumed["parent_version"]
        if resumed:
            _log(self.rank, f"resumed from {resumed['tag']} ({resumed['resumed']}), {self.records_total} records so far")
            resumed["skipped"] = self._ack_covered(resumed)
            resumed.pop("covered_ids", None)  # could be thousands of ids: not for stats or logs
        self.telemetry.started(resumed is not None)
        self.resumed = resumed
        from train.online.export import Exporter

        self.exporter = Exporter(self.cfg, self.fam, self.target, self.run_dir, self.parent_version)
        return resumed

    def _init_draft(self) -> torch.nn.Module:
        """The draft training starts from: init_draft (a directory or registry:<version id>),
        else a fresh layer draft. Sets spec_info and parent_version."""
        from infra.drafts.layer import build_draft, load_draft
        from infra.drafts.spec import draft_spec_from_train

        # Layer exports are rebuilt to the configured spec, also when training starts from a saved draft.
        self.spec_info = draft_spec_from_train(self.cfg.train)
        if self.init_draft and self.init_draft.startswith("registry:"):  # registry:<version id>
            from infra.registry import Registry

            draft, info = Registry.from_config(self.cfg).load_draft(self.init_draft.split(":", 1)[1], self.target)
            self.parent_version = info["version"]
        elif self.init_draft:
            draft, info = load_draft(self.init_draft, self.target)
            self.parent_version = info.get("version") or Path(self.init_draft).name
        else:
            draft = build_draft(self.target, self.spec_info)
            self.parent_version = None
        return draft

    def _served_forward(self, draft: Any) -> Any:
        """A head's features from the served target where it can be built (train/online/served.py),
        else None: the float32 copy's. Says which, and why, in one line."""
        from train.online.family import family_name

        if family_name(draft) != "head":
            return None
        if self.served is None:
            _log(self.rank, "head features from the float32 training copy: this trainer was given no "
                            "served forward (train/online/served.py)")
            return None
        forward, why = self.served(self.cfg)
        _log(self.rank, why)
        return forward

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    # -- the loop ----------------------------------------------------------------

    def _fill(self, buffer: list, block_ms: int) -> int:
        """Read new deliveries; held-out ones go to the α buffer, and records past the lag bound
        (train/online/lag.py) are skipped; both are acked at the next checkpoint. While whole reads
        are behind (they held stale records), read on, for up to FILL_BUDGET_S: a trainer that
        fell behind catches up in one fill instead of one read per step."""
        # Never longer than stream.block_ms, which the config keeps below the socket timeout:
        # a longer BLOCK would make every idle read a timeout error.
        block_ms = min(block_ms, self.cfg.stream.block_ms)
        # Small reads when there are several ranks, so one rank does not take every record.
        count = 4 if self.world_size > 1 else READ_COUNT
        deadline, total = time.monotonic() + FILL_BUDGET_S, 0
        while True:
            got = self.consumer.read(count=count, block_ms=block_ms)
            total += len(got)
            if not self._sort(got, buffer) or len(got) < count or time.monotonic() >= deadline:
                return total
            block_ms = 0

    def _shed(self, buffer: list) -> None:
        """Drop from the buffer what went stale while it waited (but the kept stale share), then the
        oldest beyond BUFFER_BATCHES batches: skipped, counted, acked with the next checkpoint. Only
        with a lag bound (train.max_lag_s > 0): without one every record is trained on."""
        from train.distill.batching import record_tokens
        from train.online.lag import train_on

        tc = self.cfg.train
        if tc.max_lag_s <= 0:
            return
        now = time.time()
        fresh = [d for d in buffer if train_on(d.record.record_id, d.record.created_at, now, tc.max_lag_s)]
        room, kept = BUFFER_BATCHES * tc.token_budget, []
        for d in reversed(fresh):  # newest first
            room -= record_tokens(d.record, tc.max_seq_len)
            if room < 0 and kept:
                break
            kept.append(d)
        kept.reverse()
        if len(kept) == len(buffer):
            return
        ids = {d.entry_id for d in kept}
        dropped = [d for d in buffer if d.entry_id not in ids]
        self._held_acks += dropped
        self.skipped_stale += len(dropped)
        self.telemetry.status["skipped_stale"] = self.skipped_stale
        buffer[:] = kept

    def _sort(self, got: list, buffer: list) -> int:
        """Each delivery to the held-out records, the skipped or the buffer; returns how many were
        stale (skipped, or kept as the stale share)."""
        from train.online.lag import is_stale, train_on

        tc = self.cfg.train
        now, stale = time.time(), 0
        for d in got:
            if is_held_out(d.record.record_id, tc.held_out_every):
                self._held_new = True
                self.held_out.append(d.record)
                del self.held_out[: -HELD_OUT_BUFFER]
                self._held_acks.append(d)
            elif not train_on(d.record.record_id, d.record.created_at, now, tc.max_lag_s):
                self._held_acks.append(d)
                self.skipped_stale += 1
                self.telemetry.status["skipped_stale"] = self.skipped_stale
                stale += 1
            else:
                buffer.append(d)
                stale += is_stale(d.record.created_at, now, tc.max_lag_s)
                self.trained_prompts[d.record.prompt_ids.tobytes()] = None
                if len(self.trained_prompts) > TRAINED_PROMPTS_KEPT:
                    del self.trained_prompts[next(iter(self.trained_prompts))]
        return stale

    def run(self, max_records: int | None = None, max_seconds: float | None = None,
            idle_stop_s: float | None = None) -> RunStats:
        """Train until max_records (all ranks together) or max_seconds, or until no rank has
        seen data for idle_stop_s. Checkpoints, acks and exports on the configured cadence."""
        import torch.distributed as dist

        from train.distill.batching import record_tokens, take_budget

        tc = self.cfg.train
        stats = RunStats(self.rank, resumed=self.resumed)
        loss_fn = self.fam.loss_fn()
        buffer: list = []
        unacked: list = []  # trained since the last checkpoint
        since_export, last_export = 0, time.monotonic()
        t_start, last_data = time.monotonic(), time.monotonic()
        loss_acc: list[float] = []
        # Records wait for the next checkpoint before their ack, usually longer than
        # claim_idle_ms: touch them often enough that no consumer takes them over as abandoned.
        keep_alive_every, last_keep_alive = self.cfg.stream.claim_idle_ms / 3000, time.monotonic()
        while True:
            if time.monotonic() - last_keep_alive >= keep_alive_every:
                self.consumer.keep_alive()
                last_keep_alive = time.monotonic()
            # Read every step, waiting only when short of a batch: a trainer slower than the traffic
            # must still skip what went stale, or its buffer, and then its lag, grows without bound.
            short = sum(record_tokens(d.record, tc.max_seq_len) for d in buffer) < tc.token_budget
            if self._fill(buffer, block_ms=(100 if buffer else 500) if short else 0):
                last_data = time.monotonic()
            self._shed(buffer)
            take = take_budget(buffer, tc.token_budget, tc.max_seq_len, key=lambda d: d.record)
            now = time.monotonic()
            done_local = (max_seconds is not None and now - t_start >= max_seconds) or (
                idle_stop_s is not None and not take and not buffer and now - last_data >= idle_stop_s)
            export_local = now - last_export >= tc.export_every_s
            # [have data, still running, export] under MAX: any data, any running, any export.
            flags = torch.tensor([float(bool(take)), float(not done_local), float(export_local)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            any_data, stop, export = bool(flags[0]), not bool(flags[1]), bool(flags[2])
            n_local = 0
            if any_data and not take:
                # Another rank has data: step with a zero-weight batch so the collectives stay in step.
                self.engine.train_batch(self.fam.null_batch(), loss_fn)
            elif any_data:
                self._step([d.record for d in take], loss_fn, stats, loss_acc)
                unacked += take
                n_local = len(take)
                self.replay.extend(d.record for d in take)
                del self.replay[: -REPLAY_BUFFER]
            if any_data:
                self._replay_steps(loss_fn, stats, loss_acc)
            self._look(stats)
            count = torch.tensor([float(n_local)])
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
            self.records_total += int(count)
            since_export += int(count)
            stats.records_trained += n_local
            if max_records is not None and self.records_total >= max_records:
                stop = True
            if since_export >= tc.export_every_records:
                export = True
            if (export or stop) and (unacked or since_export):
                info = self._checkpoint_and_export(unacked, loss_acc, since_export)
                stats.records_acked += info["acked"]
                if info.get("export"):
                    stats.exports.append(info["export"])
                unacked, loss_acc, since_export, last_export = [], [], 0, time.monotonic()
            if stop:
                break
        stats.dead_lettered = self.consumer.stats().dead_total
        stats.records_skipped_stale = self.skipped_stale
        return stats

    def _step(self, records: list, loss_fn, stats: RunStats, loss_acc: list[float]) -> None:
        """One optimizer step on these records, counted in stats and the export's loss."""
        batch = self.fam.batch(records)
        t0 = time.perf_counter()
        loss = self.engine.train_batch(batch, loss_fn)
        fault_point("trainer.mid_step")  # stepped, not yet counted or checkpointed
        stats.train_s += time.perf_counter() - t0
        stats.steps += 1
        stats.tokens += batch.n_tokens
        stats.losses.append(loss)
        loss_acc.append(loss)
        self.telemetry.step(loss, self.records_total)

    def _replay_steps(self, loss_fn, stats: RunStats, loss_acc: list[float]) -> None:
        """train.replay_steps more steps on records drawn again from this rank's recent ones. Every
        rank runs the same number (a null batch if it has none) so the collectives stay in step."""
        from train.distill.batching import take_budget
        from train.online.replay import replay_pool

        tc = self.cfg.train
        for _ in range(tc.replay_steps):
            pool = replay_pool(self.replay, (), 0.0, self._rng)
            take = take_budget(pool, tc.token_budget, tc.max_seq_len)
            if not take:
                self.engine.train_batch(self.fam.null_batch(), loss_fn)
                continue
            self._step(take, loss_fn, stats, loss_acc)
            stats.replay_steps += 1

    def _checkpoint_and_export(self, unacked: list, losses: list[float], n_records: int) -> dict[str, Any]:
        """Collective: checkpoint (COMPLETE last), then ack what it covers, then rank 0 publishes."""
        self.versions += 1
        covered = self._entry_ids(unacked + self._held_acks)
        tag, weights = self.engine.save(self.ckpt_dir, {"records_total": self.records_total,
                                                        "versions": self.versions,
                                                        "parent_version": self.exporter.parent_version,
                                                        "covered_ids": covered})
        fault_point("trainer.after_complete")
        acked = self.consumer.ack(unacked + self._held_acks)
        self._held_acks = []
        out: dict[str, Any] = {"acked": acked, "tag": tag}
        if self.rank == 0:
            out["export"] = self.exporter.export(
                weights, losses, n_records, version=f"{self.run_dir.name}-v{self.versions:04d}",
                held_out=self.held_out, trained_prompts=self.trained_prompts,
                records_total=self.records_total, world_size=self.world_size)
            self.telemetry.candidates(self.exporter)
        self.telemetry.checkpoint(tag, out.get("export"))
        return out

    def _look(self, stats: RunStats) -> None:
        """Rank 0, when held-out records arrived: judge the candidate waiting for evidence again
        (train/online/export.py); no collective, so the other ranks go on."""
        if (self.rank != 0 or not self._held_new or self.exporter.pending is None
                or time.monotonic() - self._last_look < LOOK_EVERY_S):
            return
        self._held_new, self._last_look = False, time.monotonic()
        export = self.exporter.look(self.held_out, self.trained_prompts)
        self.telemetry.candidates(self.exporter)
        if export:
            stats.exports.append(export)
            self.telemetry.exported(export)

    def _entry_ids(self, deliveries: list) -> list[str]:
        """Collective: the stream ids every rank's checkpoint covers (rank 0 writes COMPLETE)."""
        import torch.distributed as dist

        mine = [d.entry_id for d in deliveries]
        if self.world_size == 1:
            return mine
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return [i for ids in every for i in ids]

    def _ack_covered(self, resumed: dict[str, Any]) -> int:
        """Ack what the checkpoint resumed from covers: a process killed between COMPLETE and its
        XACK left those records pending, and they would be reclaimed and trained twice."""
        ids = resumed.get("covered_ids") or []
        n = self.consumer.ack(ids) if ids and self.rank == 0 else 0
        if n:
            _log(self.rank, f"{n} records the checkpoint already covers were still pending (killed before "
                            f"their ack): acked now, not trained again")
        return n

    def close(self) -> None:
        self.consumer.close()


class TrainerGroup:
    """N TrainerWorker actors in one placement group; rank 0 starts first for the rendezvous."""

    def __init__(self, cfg: OSDConfig, run_dir: str | os.PathLike, init_draft: str | None = None,
                 num_workers: int | None = None, family: str | None = None, served: ServedFactory | None = None):
        from ray.util.placement_group import placement_group

        self.n = num_workers or cfg.train.num_workers
        self.pg = placement_group([{"CPU": 1, **cfg.train.resources}] * self.n, strategy="PACK")
        self.workers: list = []
        try:
            self._start(cfg, run_dir, init_draft, family, served)
        except BaseException:
            # A start that fails (Redis away during setup) must give its CPUs back, or every
            # restart after it waits for a placement group that can never be placed.
            self.shutdown()
            raise

    def _start(self, cfg: OSDConfig, run_dir: str | os.PathLike, init_draft: str | None,
               family: str | None, served: ServedFactory | None) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as strategy

        ray.get(self.pg.ready(), timeout=120)
        actor = ray.remote(num_cpus=1, resources=dict(cfg.train.resources))(TrainerWorker)
        cfg_dict = cfg.model_dump(mode="json")
        env = {"env_vars": {"DS_ACCELERATOR": "cpu"}} if cfg.train.device == "cpu" else {}

        group_id = os.urandom(4).hex()

        def start(rank: int):
            return actor.options(
                name=f"osd-trainer-{group_id}-rank{rank}",  # findable for ops (and the kill test)
                scheduling_strategy=strategy(placement_group=self.pg, placement_group_bundle_index=rank),
                runtime_env=env, max_restarts=0,
            ).remote(cfg_dict, rank, self.n, str(run_dir), init_draft, family=family, served=served)

        self.workers = [start(0)]
        addr, port = ray.get(self.workers[0].address.remote(), timeout=120)
        self.workers += [start(r) for r in range(1, self.n)]
        self.resumed = ray.get([w.setup.remote(addr, port) for w in self.workers], timeout=600)

    def async_run(self, **kw) -> list:
        return [w.run.remote(**kw) for w in self.workers]

    def run(self, timeout: float | None = None, **kw) -> list[RunStats]:
        """Blocks; raises as soon as any worker fails (the others would wait in a collective)."""
        refs = self.async_run(**kw)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                raise TimeoutError(f"trainer group did not finish in {timeout} s")
            ray.get(done[0])
        return ray.get(refs)

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            ray.kill(w, no_restart=True)
        remove_placement_group(self.pg)


# Group starts after a failure: 1 s, 2 s, 4 s ... at most RETRY_CAP_S apart, for train.retry_for_s.
RETRY_BASE_S = 1.0
RETRY_CAP_S = 30.0
# Errors of a worker or its start (Redis away during setup, a lost node); others end the run.
_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError)


def run_with_restarts(cfg: OSDConfig, run_dir: str | os.PathLike, *, restarts: int | None = None,
                      init_draft: str | None = None, family: str | None = None, served: ServedFactory | None = None,
                      sleep: Any = time.sleep, clock: Any = time.monotonic, **run_kw) -> list[RunStats]:
    """Run a group; if it fails to start or a worker dies, tear it down and start a new one that
    resumes from the newest COMPLETE checkpoint (its unacked records are reclaimed from the
    stream), after a doubling back-off, for up to train.retry_for_s after the first failure in
    a row (and at most `restarts` times when given): a Redis outage shorter than that does not
    end standalone training. A run that lasted RETRY_CAP_S was healthy: its failure starts over."""
    from infra.common.backoff import backoff_delay

    budget = cfg.train.retry_for_s
    failures, first_failure, last_err = 0, 0.0, None
    while True:
        started = clock()
        try:
            return _run_group(cfg, run_dir, init_draft, family, served, run_kw)
        except _RETRYABLE as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):  # a setting or draft the workers refuse: the same next time
                raise cause from None
            last_err = e
        if failures == 0 or clock() - started >= RETRY_CAP_S:
            failures, first_failure = 0, started
        failures += 1
        delay = backoff_delay(failures, RETRY_BASE_S, RETRY_CAP_S)
        if (restarts is not None and failures > restarts) or clock() + delay > first_failure + budget:
            raise RuntimeError(f"training failed after {failures - 1} restarts in {clock() - first_failure:.0f} s "
                               f"(train.retry_for_s = {budget:g}); last error: {type(last_err).__name__}") from last_err
        print(f"[osd train] the trainer group failed ({type(last_err).__name__}); starting it again in "
              f"{delay:.0f} s (restart {failures}; train.retry_for_s = {budget:g})", flush=True)
        sleep(delay)


def _run_group(cfg: OSDConfig, run_dir: str | os.PathLike, init_draft: str | None, family: str | None,
               served: ServedFactory | None, run_kw: dict[str, Any]) -> list[RunStats]:
    # A group that fails to start shuts itself down.
    group = TrainerGroup(cfg, run_dir, init_draft=init_draft, family=family, served=served)
    try:
        return group.run(**run_kw)
    finally:
        group.shutdown()


def save_stats(stats: list[RunStats], path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps([s.__dict__ for s in stats], indent=2, default=str))
