"""A bounded soak (a bench, not a test): the whole local loop (`osd up`) under mixed load for
N minutes while it trains and promotes, sampling every ~10 s what could grow without end:

- RSS of each process of the stack, summed by role (driver, replica, ingress, trainer,
  controller, serve, ray, redis; a lone replica holds the ingress, serve.ingress auto);
- disk of the state dir: registry versions, the audit log, the trainer's checkpoints, Redis's AOF,
  the replicas' record spools, and the whole state dir;
- Redis used_memory.

A series is flat when the max of its last third is within its bound: the configured retention
for what has one (checkpoints: train.keep_checkpoints + 1 being written, each as large as the
largest seen; registry versions: what Registry.gc keeps, registry.keep_last plus the aliased,
the recently audited and one being published; Redis: stream.memory_budget_mb), else (RSS) the first two thirds' max plus 10% and 32 MB. Printed as a
table and written as JSON.

`osd bench soak --minutes 3` (the tiny target unless `--target` names another).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from infra.config import OSDConfig

SAMPLE_EVERY_S = 10.0
RSS_SLACK = (1.10, 32.0)  # RSS bound without a retention: earlier max x 1.10 + 32 MB
# The tiny target's loop turns in seconds with these: a candidate every 12 records, a canary
# decided after a few requests (the same cadence as the whole-stack tests).
FAST_LOOP = {
    "serve": {"max_new_tokens": 32, "num_cpus_per_replica": 0.5, "alias_poll_s": 0.5},
    "train": {"export_every_records": 12, "export_every_s": 1000, "held_out_every": 5,
              "gate": {"min_records": 2, "resamples": 200}},
    "rollout": {"canary_steps": [0.5, 1.0], "min_requests": 4, "max_requests": 40, "poll_s": 0.5},
}
TINY = {"train": {"draft_layers": 1, "token_budget": 256, "max_seq_len": 128}}


def _log(msg: str) -> None:
    print(f"[osd soak] {msg}", flush=True)


# -- what is sampled ---------------------------------------------------------------------------

def role_of(cmdline: list[str]) -> str:
    """Which part of the stack a process is, from its command line (Ray sets its workers' titles)."""
    line = " ".join(cmdline)
    for needle, role in (("redis-server", "redis"), ("TargetReplica", "replica"), ("OpenAIIngress", "ingress"),
                         ("TrainerWorker", "trainer"), ("_ControllerActor", "controller"),
                         ("ServeController", "serve"), ("ProxyActor", "serve")):
        if needle in line:
            return role
    return "ray"


def rss_by_role(root_pid: int) -> dict[str, float]:
    """MB of resident memory of `root_pid` (the driver) and its process tree, by role."""
    import psutil

    root = psutil.Process(root_pid)
    out: dict[str, float] = {"driver": root.memory_info().rss / 2**20}
    for p in root.children(recursive=True):
        try:
            role = role_of(p.cmdline())
            out[role] = out.get(role, 0.0) + p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {k: round(v, 1) for k, v in sorted(out.items())}


def dir_mb(path: Path) -> float:
    # os.walk, not rglob: a directory removed while it is walked (registry gc, checkpoint
    # pruning) is skipped, where rglob raised and ended the soak.
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    total += os.stat(p).st_size
            except OSError:  # removed while walked (a pruned checkpoint)
                continue
    return round(total / 2**20, 3)


def disk_mb(state_dir: Path, run_name: str) -> dict[str, float]:
    return {"registry_versions": dir_mb(state_dir / "registry" / "versions"),
            "registry_audit": dir_mb(state_dir / "registry" / "audit"),
            "checkpoints": dir_mb(state_dir / "train" / run_name / "checkpoints"),
            "redis_aof": dir_mb(state_dir / "redis"),
            # The replicas' record spools (infra/records/spool.py): emptied as their records are written.
            "spool": dir_mb(state_dir / "spool"),
            "state_dir": dir_mb(state_dir)}


def largest_entry_mb(path: Path) -> float:
    """The largest immediate subdirectory (one checkpoint, one version), MB."""
    if not path.is_dir():
        return 0.0
    return max((dir_mb(p) for p in path.iterdir() if p.is_dir()), default=0.0)


@dataclass
class Sample:
    t_s: float
    rss_mb: dict[str, float]
    disk_mb: dict[str, float]
    redis_used_mb: float | None
    stream_len: int | None
    requests_ok: int
    requests_failed: int
    versions: int
    stable: str | None
    decisions: int  # the rollout controller's final decisions so far (promote, rollback, gated, expired)
    trainer_read: int | None  # entries the trainers' consumer group has read
    checkpoint_mb_max: float
    version_mb_max: float


# -- the load ----------------------------------------------------------------------------------

class MixedLoad:
    """`clients` threads, each request a random mix: chat or completion, streamed or not,
    8 to 32 tokens, over varied prompts. Counts ok and failed; never raises."""

    def __init__(self, url: str, clients: int, seed: int = 0, timeout_s: float = 120.0):
        self.url, self.timeout_s = url, timeout_s
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        import httpx

        self._http = httpx.Client(timeout=timeout_s)  # thread-safe; one pool for every client thread
        self._threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True, name=f"soak-{i}")
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        topics = ["rivers", "prime numbers", "bread", "the moon", "sorting", "tea", "maps", "bees"]
        i = 0
        while not self._stop.is_set():
            i += 1
            chat, stream = rng.random() < 0.7, rng.random() < 0.5
            text = f"Tell me about {rng.choice(topics)} ({seed}-{i}). " * rng.randint(1, 4)
            body: dict[str, Any] = {"model": "osd", "max_tokens": rng.choice([8, 16, 32]), "stream": stream,
                                    "temperature": rng.choice([0.0, 0.0, 0.7])}
            body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
            err = self._one(f"/v1/{'chat/completions' if chat else 'completions'}", body, stream)
            with self._lock:
                if err is None:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors = (self.errors + [err])[-20:]

    def _one(self, path: str, body: dict[str, Any], stream: bool) -> str | None:
        import httpx

        try:
            if not stream:
                resp = self._http.post(self.url + path, json=body)
                resp.raise_for_status()
                resp.json()
                return None
            with self._http.stream("POST", self.url + path, json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    line = line.strip()
                    if line == "data: [DONE]":
                        return None
                    if line.startswith("data: ") and '"error"' in line:
                        return line[:300]
                return "the stream ended without [DONE]"
        except (httpx.HTTPError, OSError, ValueError) as e:
            return f"{type(e).__name__}: {e}"[:300]

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.ok, self.failed

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        self._http.close()


# -- the verdict -------------------------------------------------------------------------------

def flat(values: list[float], bound: float) -> dict[str, Any]:
    third = max(1, len(values) // 3)
    last = max(values[-third:]) if values else 0.0
    return {"first": values[0] if values else None, "last_third_max": last, "bound": round(bound, 3),
            "flat": last <= bound}


def rss_bound(values: list[float]) -> float:
    """Without a retention: the first two thirds' max, plus RSS_SLACK."""
    early = values[: max(1, len(values) - max(1, len(values) // 3))]
    return max(early) * RSS_SLACK[0] + RSS_SLACK[1]


def verdicts(samples: list[Sample], cfg: OSDConfig) -> dict[str, dict[str, Any]]:
    from infra.registry import AUDIT_PROTECT

    out: dict[str, dict[str, Any]] = {}
    roles = sorted({r for s in samples for r in s.rss_mb})
    for role in roles:
        vals = [s.rss_mb.get(role, 0.0) for s in samples]
        out[f"rss_mb.{role}"] = flat(vals, rss_bound(vals))
    ckpt = max(s.checkpoint_mb_max for s in samples)
    out["disk_mb.checkpoints"] = flat([s.disk_mb["checkpoints"] for s in samples],
                                      (cfg.train.keep_checkpoints + 1) * ckpt)
    # What Registry.gc keeps: keep_last newest, each alias's version (stable, its previous, the
    # canary), those the newest AUDIT_PROTECT audit entries name; plus one being published.
    kept = cfg.registry.keep_last + 3 + AUDIT_PROTECT + 1
    version = max(s.version_mb_max for s in samples)
    out["versions"] = flat([float(s.versions) for s in samples], float(kept))
    out["disk_mb.registry_versions"] = flat([s.disk_mb["registry_versions"] for s in samples], kept * version)
    used = [s.redis_used_mb for s in samples if s.redis_used_mb is not None]
    if used:
        out["redis_used_mb"] = flat(used, float(cfg.stream.memory_budget_mb))
    return out


# -- the run -----------------------------------------------------------------------------------

@dataclass
class SoakResult:
    minutes: float
    clients: int
    target: str
    samples: list[Sample] = field(default_factory=list)
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    warmup_s: float = 0.0
    requests_ok: int = 0
    requests_failed: int = 0
    errors: list[str] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def all_flat(self) -> bool:
        return all(v["flat"] for v in self.verdicts.values())


def soak_config(cfg: OSDConfig, state_dir: Path, port: int) -> OSDConfig:
    from infra.config import load_config as _load

    over: dict[str, Any] = {k: dict(v) for k, v in FAST_LOOP.items()}
    if cfg.model.target == "tiny-random":
        for k, v in TINY.items():
            over[k] = {**over.get(k, {}), **v}
    over["serve"]["port"] = port
    base = cfg.model_dump(mode="json")
    for k, v in over.items():
        base[k] = {**base[k], **v}
    base["state_dir"] = str(state_dir)
    base["stream"]["redis_url"] = ""  # its own private Redis, whatever the config names
    return _load(environ={}, overrides=base)


def _tiny_warm_start(state_dir: Path) -> None:
    """What `osd draft init --family layer` leaves for the tiny target, made here in a second."""
    from infra.drafts.layer import DraftSpec, build_draft, save_draft
    from infra.target import load_target

    tiny = load_target("tiny-random", progress=False)
    spec = DraftSpec(num_layers=1)
    save_draft(build_draft(tiny.model, spec), spec, state_dir / "drafts" / "v1", target_ref={"spec": "tiny-random"})


def run_soak(cfg: OSDConfig, *, minutes: float = 20.0, clients: int = 2, sample_s: float = SAMPLE_EVERY_S,
             state_dir: str | Path | None = None, json_path: str | Path | None = None,
             warmup_s: float = 600.0) -> SoakResult:
    """Run the loop with mixed load for `minutes`, sampling every `sample_s`; print the table and
    the verdicts, write JSON to `json_path` if given."""

    import redis

    from infra.drafts.spec import warm_started_draft
    from infra.redis.server import free_port
    from infra.registry import Registry
    from pipeline.stack.up import ClosedLoop

    tmp = None
    if state_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="osd-soak-")
        state_dir = tmp.name
    state = Path(state_dir).resolve()
    cfg = soak_config(cfg, state, free_port())
    reg = Registry.from_config(cfg)
    if reg.alias("stable") is None and warm_started_draft(cfg) is None and cfg.model.target == "tiny-random":
        _tiny_warm_start(state)
    run_name = "soak"
    result = SoakResult(minutes=minutes, clients=clients, target=cfg.model.target)
    loop = ClosedLoop(cfg, run_name=run_name).start()
    client = redis.Redis.from_url(loop.cfg.stream.redis_url, socket_timeout=5)
    load = MixedLoad(loop.url, clients)
    try:
        # The clock starts once the trainer reads: its first start (DeepSpeed's set-up, a CPU op
        # build on a cold cache) is not what a soak measures.
        t_up = time.monotonic()
        _log(f"warming up: waiting up to {warmup_s:.0f} s for the trainer's first read")
        while not _trainer_read(client, loop.cfg.stream.stream) and time.monotonic() - t_up < warmup_s:
            time.sleep(2)
        result.warmup_s = round(time.monotonic() - t_up, 1)
        t0 = time.monotonic()
        _log(f"{minutes:g} min of mixed load ({clients} clients) on {cfg.model.target}, a sample every {sample_s:g} s; "
             f"state in {state}")
        while True:
            s = _sample(time.monotonic() - t0, os.getpid(), state, run_name, client, loop.cfg.stream.stream, load, reg)
            result.samples.append(s)
            _log(f"{s.t_s:.0f} s: {s.requests_ok} ok, {s.requests_failed} failed, {s.versions} versions, "
                 f"redis {s.redis_used_mb} MB, stable {s.stable}")
            left = minutes * 60 - (time.monotonic() - t0)
            if left <= 0:
                break
            time.sleep(min(sample_s, left))
        result.decisions = [{k: d.get(k) for k in ("action", "version", "reason")}
                            for d in loop.controller_status()["decisions"]]
    finally:
        load.stop()
        result.requests_ok, result.requests_failed = load.counts()
        result.errors = load.errors
        loop.stop()
        if tmp is not None:
            tmp.cleanup()
    result.verdicts = verdicts(result.samples, cfg)
    _report(result)
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**asdict(result), "all_flat": result.all_flat}, indent=2) + "\n")
        _log(f"wrote {path}")
    return result


def _sample(t: float, pid: int, state: Path, run_name: str, client: Any, stream: str, load: MixedLoad,
            reg: Any) -> Sample:
    import redis

    try:
        used: float | None = round(int(client.info("memory")["used_memory"]) / 2**20, 3)
        xlen: int | None = int(client.xlen(stream))
    except redis.RedisError:
        used = xlen = None
    ok, failed = load.counts()
    versions = reg.list()
    stable = reg.alias("stable")
    return Sample(t_s=round(t, 1), rss_mb=rss_by_role(pid), disk_mb=disk_mb(state, run_name), redis_used_mb=used,
                  stream_len=xlen, requests_ok=ok, requests_failed=failed, versions=len(versions),
                  stable=stable and stable["version"], decisions=_decisions(reg),
                  trainer_read=_trainer_read(client, stream),
                  checkpoint_mb_max=largest_entry_mb(state / "train" / run_name / "checkpoints"),
                  version_mb_max=largest_entry_mb(state / "registry" / "versions"))


def _decisions(reg: Any) -> int:
    from pipeline.rollout.controller import FINAL

    return sum(1 for e in reg.audit_log() if e.get("action") in FINAL)


def _trainer_read(client: Any, stream: str) -> int | None:
    import redis

    from infra.records.streams import group_info

    try:
        read = (group_info(client, stream).get("trainers") or {}).get("entries-read")
    except redis.RedisError:
        return None
    return None if read is None else int(read)


_ROLES = ("driver", "replica", "ingress", "trainer", "controller", "serve", "ray", "redis")


HEADERS = ["t_s", *_ROLES, "ckpt", "reg", "audit", "aof", "spool", "state", "redisMB", "xlen", "ok", "fail", "vers", "read", "dec",
           "stable"]


def _row(s: Sample) -> list[Any]:
    d = s.disk_mb
    return [round(s.t_s), *(s.rss_mb.get(r) for r in _ROLES), d["checkpoints"], d["registry_versions"],
            d["registry_audit"], d["redis_aof"], d["spool"], d["state_dir"], s.redis_used_mb, s.stream_len, s.requests_ok, s.requests_failed,
            s.versions, s.trainer_read, s.decisions, s.stable]


def _report(r: SoakResult) -> None:
    print(tabulate([_row(x) for x in r.samples], headers=HEADERS, floatfmt=".1f", missingval="-"))
    print(f"\nwarm-up (until the trainer's first read): {r.warmup_s:.0f} s")
    print(f"requests: {r.requests_ok} ok, {r.requests_failed} failed"
          + (f" (last: {r.errors[-1]})" if r.errors else ""))
    acts: dict[str, int] = {}
    for d in r.decisions:
        acts[d["action"]] = acts.get(d["action"], 0) + 1
    print(f"rollout decisions: {acts or 'none'}")
    rows = [[name, v["first"], v["last_third_max"], v["bound"], "yes" if v["flat"] else "NO"]
            for name, v in r.verdicts.items()]
    print("\n" + tabulate(rows, headers=["series", "first", "last third max", "bound", "flat"], floatfmt=".1f",
                          missingval="-"))
    print(f"\nflat within retention: {'yes' if r.all_flat else 'NO'}", flush=True)


# -- the command -------------------------------------------------------------------------------

HELP = "the whole local loop under mixed load for N minutes: is memory, disk and Redis flat?"
ERRORS: tuple[type[Exception], ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=20.0, metavar="M", help="how long (default 20)")
    parser.add_argument("--clients", type=int, default=2, metavar="N", help="concurrent clients (default 2)")
    parser.add_argument("--sample-s", type=float, default=SAMPLE_EVERY_S, metavar="S",
                        help=f"seconds between samples (default {SAMPLE_EVERY_S:g})")
    parser.add_argument("--target", default="tiny-random", metavar="SPEC",
                        help="the target the loop serves (default tiny-random: the loop turns in seconds)")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="state dir (registry, checkpoints, Redis); default a fresh temporary one")
    parser.add_argument("--json", metavar="PATH", default="reports/bench/soak.json", help="where to write JSON")


def run(cfg: OSDConfig, args: argparse.Namespace) -> int:
    """0 when every series stayed flat and no request failed, 1 otherwise."""
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"target": args.target})})
    r = run_soak(cfg, minutes=args.minutes, clients=args.clients, sample_s=args.sample_s,
                 state_dir=args.state_dir, json_path=args.json)
    return 0 if r.all_flat and r.requests_failed == 0 else 1
