"""The whole local stack (`osd up`'s ClosedLoop: private Redis, Ray Serve replicas of the tiny
target, a trainer group, the rollout controller) for the fault scenarios, a bounded streaming
load through the OpenAI API, the processes to kill, and the invariants' measurements."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# A client read that waits this long for the next SSE line is a hang, whatever the fault.
HANG_S = 90.0


def stack_config(state_dir: Path, port: int, **sections: dict) -> Any:
    """The tiny loop, tuned so the loop turns within seconds: a fast alias poll and controller,
    exports every few records. Redis timeouts are the defaults, as users run them."""
    from infra.config import load_config

    base = {
        "state_dir": str(state_dir), "model": {"target": "tiny-random"},
        "serve": {"port": port, "max_new_tokens": 16, "num_cpus_per_replica": 0.5, "alias_poll_s": 0.3},
        "train": {"draft_layers": 1, "export_every_records": 12, "export_every_s": 1000, "held_out_every": 5,
                  "token_budget": 256, "max_seq_len": 128, "gate": {"min_records": 2, "resamples": 200}},
        "rollout": {"canary_steps": [0.5, 1.0], "min_requests": 4, "max_requests": 40, "poll_s": 0.3},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return load_config(environ={}, overrides=base)


def write_warm_start(tiny: Any, state_dir: Path) -> None:
    """<state_dir>/drafts/v1: what `osd draft init --family layer` leaves, so `up` publishes v1."""
    from infra.drafts.layer import DraftSpec, build_draft, save_draft

    spec = DraftSpec(num_layers=1)
    save_draft(build_draft(tiny.model, spec), spec, state_dir / "drafts" / "v1", target_ref={"spec": "tiny-random"})


@dataclass
class Outcome:
    """One streamed request: done = it ended with [DONE]; error = the SSE error event's code, or
    the HTTP status/exception that ended it; hang = a read waited HANG_S."""
    started: float
    ended: float = 0.0
    done: bool = False
    error: str | None = None
    hang: bool = False
    tokens: int = 0
    version: str | None = None
    record_id: str | None = None  # the id of the record the request produced (its last chunk's "osd")

    @property
    def ok(self) -> bool:
        return self.done and self.error is None and not self.hang


def stream_chat(url: str, text: str, max_tokens: int) -> Outcome:
    """One streamed greedy chat completion, read line by line to [DONE]."""
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = Outcome(started=time.time())
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("code") or event["error"].get("message"))
                    continue
                out.version = event.get("draft_version", out.version) or out.version
                out.record_id = (event.get("osd") or {}).get("record_id") or out.record_id
                if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                    out.tokens += 1
    except TimeoutError:
        out.hang = True
    except urllib.error.HTTPError as e:
        out.error = f"HTTP {e.code}: {e.read()[:200]!r}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        if "timed out" in str(e):
            out.hang = True
        else:
            out.error = f"{type(e).__name__}: {e}"
    out.ended = time.time()
    return out


class Load:
    """`clients` threads streaming chat completions in a closed loop until stop()."""

    def __init__(self, url: str, clients: int = 2, max_tokens: int = 12):
        self.url, self.max_tokens = url, max_tokens
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"load-{i}")
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, seed: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            o = stream_chat(self.url, f"tell me about item {seed}-{i} and its neighbours", self.max_tokens)
            with self._lock:
                self.outcomes.append(o)

    def completed_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok and o.started >= t)

    def wait_completed_since(self, t: float, n: int, timeout: float, what: str) -> None:
        wait_for(lambda: self.completed_since(t) >= n, timeout, what)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(HANG_S + 30)
        assert not any(t.is_alive() for t in self._threads), "a load client never returned"
        return list(self.outcomes)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return got


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def replica_stats(url: str) -> list[dict[str, Any]]:
    """Each replica's record counters, as the ingress last saw them."""
    return get_json(f"{url}/osd/stats")["replicas"]


@dataclass
class Accounting:
    """Records: what the replicas produced against what the stream and its groups hold."""
    submitted: int
    written: int
    dropped: dict[str, int]
    queued: int
    xlen: int
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def dropped_by_reason(reps: list[dict[str, Any]]) -> dict[str, int]:
    """The replicas' drops summed by reason (from /osd/stats alone: readable while Redis is down)."""
    dropped: dict[str, int] = {}
    for r in reps:
        for k, n in r["dropped_by_reason"].items():
            dropped[k] = dropped.get(k, 0) + n
    return dropped


def accounting(url: str, client: Any, stream: str) -> Accounting:
    from infra.records.streams import group_info

    reps = replica_stats(url)
    return Accounting(submitted=sum(r["records_submitted"] for r in reps),
                      written=sum(r["records_written"] for r in reps), dropped=dropped_by_reason(reps),
                      queued=sum(r.get("queued", 0) for r in reps), xlen=int(client.xlen(stream)),
                      groups=group_info(client, stream))


def settled_accounting(url: str, client: Any, stream: str, timeout: float = 60.0, replicas: int = 1) -> Accounting:
    """The counters once every submitted record is written or dropped (the load has stopped), read
    after `replicas` replicas have reported since this call began: /osd/stats reaches the replicas
    through a few load-balanced calls and keeps each one's last counters, so one replica's could
    otherwise be minutes old."""
    since = time.time()

    def settled() -> Accounting | None:
        if sum(r.get("time", 0) >= since for r in replica_stats(url)) < replicas:
            return None
        a = accounting(url, client, stream)
        return a if a.submitted == a.written + a.dropped_total else None

    return wait_for(settled, timeout, f"every submitted record to be written or dropped, and {replicas} replicas' "
                                      f"counters read since")


def actor_pid(handle: Any) -> int:
    """The process of a live actor, from the GCS's actor table: asking the actor itself would
    queue behind a long call it is running (the trainer's run)."""
    from ray._private.state import actors

    info = actors(actor_id=handle._actor_id.hex())
    assert info["State"] == "ALIVE" and info["Pid"], info
    return int(info["Pid"])


class AliasWatch:
    """Checks, every `every` s while a scenario runs, that each alias names a version that loads
    on the target (digests checked); a version is loaded once. failures: (alias, version, error)
    for a version an alias still named after its load failed."""

    def __init__(self, cfg: Any, target_model: Any, every: float = 0.3):
        from infra.registry import Registry

        self.reg, self.model, self.every = Registry.from_config(cfg), target_model, every
        self.loaded: set[str] = set()
        self.failures: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="alias-watch")
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def check(self) -> None:
        for name, alias in self.reg.aliases().items():
            version = alias and alias["version"]
            if not version or version in self.loaded:
                continue
            try:
                self.reg.load_draft(version, self.model)
                self.loaded.add(version)
            except Exception as e:  # noqa: BLE001 - any failure to load is what is watched for
                still = (self.reg.alias(name) or {}).get("version")
                if still == version:  # not a version the alias left (and gc removed) meanwhile
                    self.failures.append((name, version, f"{type(e).__name__}: {e}"))

    def stop(self) -> "AliasWatch":
        self._stop.set()
        self._t.join(30)
        self.check()
        return self
