"""`osd up`: the whole loop on one machine.

    Ray ─┬─ Serve: OpenAI ingress -> target replicas (draft: registry aliases, hot swap)
         │          └─ records ─> Redis stream (private redis-server unless stream.redis_url)
         ├─ trainer group (DeepSpeed) <─ stream group "trainers" ─> candidates -> registry
         └─ rollout controller        <─ stream group "rollout"  ─> canary/stable aliases

The registry must have a stable version, or a warm-start draft to publish as the first one:
`osd draft init` writes <state_dir>/drafts/head-v1 (`--family layer`: drafts/v1), which `up`
publishes as v1 and promotes when the registry is empty (the head when both exist). The
trainer starts from the stable version and keeps its own lineage; its candidates go through
the canary. A trainer that fails (a worker dies, Redis is away for
a while) is restarted from its last COMPLETE checkpoint after a capped exponential back-off,
for as long as `up` runs: an outage delays training, it never ends it. Everything stops in
reverse order.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from infra.common.backoff import backoff_delay
from infra.config import OSDConfig
from infra.drafts.spec import loop_draft

# Trainer restarts: 1 s, 2 s, 4 s ... at most RESTART_CAP_S apart, without end. A run that
# lasted RESTART_CAP_S or more was healthy, so its failure starts the back-off over.
RESTART_BASE_S = 1.0
RESTART_CAP_S = 60.0


def _log(msg: str) -> None:
    print(f"[osd up] {msg}", flush=True)


class UpError(RuntimeError):
    pass


def restart_delay(failures: int, base_s: float = RESTART_BASE_S, cap_s: float = RESTART_CAP_S) -> float:
    """Seconds before the restart that follows the `failures`-th failure in a row (1, 2, ...)."""
    return backoff_delay(failures, base_s, cap_s)


def failure_reason(e: BaseException) -> str:
    """A failure in one line for logs and status: the error's type and its message's last line."""
    # A RayTaskError's text is the remote traceback; its last line names the actual error.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def supervise(run_once: Callable[[], Any], stopping: threading.Event, *, base_s: float = RESTART_BASE_S,
              cap_s: float = RESTART_CAP_S, wait: Callable[[float], bool] | None = None,
              clock: Callable[[], float] = time.monotonic, log: Callable[[str], None] = _log) -> int:
    """Call run_once until it returns or `stopping` is set, restarting it after any exception with
    a capped exponential back-off that never gives up. Returns the number of restarts.
    `wait(seconds)` returns True if stopping was set meanwhile (threading.Event.wait)."""
    wait = wait or stopping.wait
    failures = restarts = 0
    while not stopping.is_set():
        started = clock()
        try:
            run_once()
            return restarts
        except Exception as e:  # anything: a trainer thread that dies silently is worse than a retry
            if stopping.is_set():
                return restarts
            failures = 1 if clock() - started >= cap_s else failures + 1
            delay = restart_delay(failures, base_s, cap_s)
            log(f"trainer failed ({failure_reason(e)}); restart {restarts + 1} in {delay:.0f} s, "
                f"from the last COMPLETE checkpoint")
            if wait(delay):
                return restarts
            restarts += 1
    return restarts


def ensure_stable(cfg: OSDConfig, warm_start_dir: str | Path | None = None) -> str:
    """The stable version id, publishing and promoting the warm-start draft if the registry has none."""
    from infra.drafts.spec import warm_start_path, warm_started_draft
    from infra.registry import Registry

    reg = Registry.from_config(cfg)
    stable = reg.alias("stable")
    if stable:
        return stable["version"]
    src = Path(warm_start_dir) if warm_start_dir else warm_started_draft(cfg)
    if src is None or not src.is_dir():
        missing = (f"{src} does not exist" if src else f"neither {warm_start_path(cfg, 'head')} nor "
                   f"{warm_start_path(cfg, 'layer')} holds a finished warm start")
        raise UpError(f"the registry {reg.uri} has no stable draft and {missing}; run `osd draft init` first "
                      f"(the head; `--family layer` for the layer draft), or `osd registry publish DIR` + "
                      f"`osd registry promote ID`")
    existing = [v.id for v in reg.list()]
    version = reg.publish(src, "v1") if "v1" not in existing else reg.get("v1")
    reg.promote(version.id, reason="warm start")
    _log(f"published {src} as {version.id} and made it stable")
    return version.id


class ClosedLoop:
    """Serve + trainer + controller over one Ray, one Redis and one registry."""

    def __init__(self, cfg: OSDConfig, api_key: str | None = None, train: bool = True,
                 run_name: str | None = None):
        self.cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft": loop_draft(cfg.serve.draft)})})
        self.api_key, self.train = api_key, train
        self.run_name = run_name or time.strftime("run%Y%m%d-%H%M%S")
        self.stack: Any = None
        self.controller: Any = None
        self._trainer_thread: threading.Thread | None = None
        self._trainer_group: Any = None
        self._stopping = threading.Event()
        self.trainer_error: str | None = None

    @property
    def url(self) -> str:
        return self.stack.url

    def start(self) -> "ClosedLoop":
        from pipeline.rollout.controller import start_controller
        from pipeline.stack.launch import LocalStack

        stable = ensure_stable(self.cfg)
        self.stack = LocalStack(self.cfg, self.api_key)
        self.stack.start()
        self.cfg = self.stack.cfg  # now with the private Redis URL
        _log(f"serving at {self.stack.url}/v1 with stable draft {stable} (replicas follow the registry aliases)")
        self.controller = start_controller(self.cfg)
        _log("rollout controller running (steps "
             f"{', '.join(f'{w:.0%}' for w in self.cfg.rollout.canary_steps)}, margin {self.cfg.rollout.margin})")
        if self.train:
            self._start_trainer(stable)
        return self

    def _start_trainer(self, stable: str) -> None:
        from pipeline.teacher.served_forward import served_forward
        from train.online.trainer import TrainerGroup

        run_dir = Path(self.cfg.state_dir) / "train" / self.run_name

        def run_once() -> None:
            # A restart builds the draft from the stable version now: the one it started from may
            # have been collected since (registry.keep_last), and the weights come from the
            # group's last COMPLETE checkpoint anyway.
            start = self._current_stable() or stable
            try:
                self._trainer_group = TrainerGroup(self.cfg, run_dir, init_draft=f"registry:{start}",
                                                   served=served_forward)
                _log(f"trainer: {self._trainer_group.n} worker(s), ZeRO-{self.cfg.train.zero_stage}, "
                     f"from {start}; a candidate every {self.cfg.train.export_every_records} records "
                     f"or {self.cfg.train.export_every_s:.0f} s")
                self._trainer_group.run()
            except Exception as e:
                self.trainer_error = failure_reason(e)
                raise
            finally:  # whoever takes the group out of self._trainer_group shuts it down (or stop_trainer)
                group, self._trainer_group = self._trainer_group, None
                if group is not None:
                    group.shutdown()

        self._trainer_thread = threading.Thread(
            target=supervise, args=(run_once, self._stopping), name="osd-trainer-group", daemon=True,
            kwargs={"base_s": RESTART_BASE_S, "cap_s": RESTART_CAP_S})
        self._trainer_thread.start()

    def _current_stable(self) -> str | None:
        from infra.registry import Registry, RegistryError

        try:
            return (Registry.from_config(self.cfg).alias("stable") or {}).get("version")
        except (RegistryError, OSError):
            return None

    def stop_trainer(self) -> None:
        """Stop training (serving and rollout go on); the group's checkpoints stay."""
        self._stopping.set()
        group, self._trainer_group = self._trainer_group, None
        if group is not None:
            group.shutdown()
        if self._trainer_thread is not None:
            self._trainer_thread.join(timeout=60)

    def stop_rollout(self) -> None:
        """Stop the rollout controller's decisions (serving goes on; its status stays readable)."""
        import ray

        if self.controller is not None:
            ray.get(self.controller.stop.remote(), timeout=30)

    def controller_status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.status.remote(), timeout=30)

    def samples(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.controller.samples.remote(), timeout=30)

    def stop(self) -> None:
        """Trainer, controller, then serving; a part that Ray cannot reach any more (its actor
        died, the call timed out) is logged and the rest still stops."""
        import ray

        try:
            self.stop_trainer()
        except ray.exceptions.RayError as e:
            _log(f"stopping the trainer group failed ({failure_reason(e)}); stopping the rest")
        if self.controller is not None:
            try:
                ray.get(self.controller.stop.remote(), timeout=30)
                ray.kill(self.controller)
            except ray.exceptions.RayError as e:
                _log(f"stopping the rollout controller failed ({failure_reason(e)}); stopping the rest")
        if self.stack is not None:
            self.stack.stop()

    def __enter__(self) -> "ClosedLoop":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run_up(cfg: OSDConfig, api_key: str | None = None, train: bool = True) -> int:
    from pipeline.stack.launch import wait_for_signal

    loop = ClosedLoop(cfg, api_key, train=train).start()
    print(f"osd is up: OpenAI-compatible API at {loop.url}/v1 (Ctrl-C to stop)\n"
          f"  ops page: {loop.url}/ops{'  (sign in with the API key)' if api_key else ''}\n"
          f"  registry: osd registry list   audit: {cfg.registry.uri or Path(cfg.state_dir) / 'registry'}/audit",
          flush=True)
    wait_for_signal()
    loop.stop()
    return 0
