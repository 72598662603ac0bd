"""`osd up`: the whole loop on one machine.

    Ray ─┬─ Serve: OpenAI ingress -> target replicas (draft: registry aliases, hot swap)
         │          └─ records ─> Redis stream (private redis-server unless stream.redis_url)
         ├─ trainer group (DeepSpeed) <─ stream group "trainers" ─> candidates -> registry
         └─ rollout controller        <─ stream group "rollout"  ─> canary/stable aliases

The registry must have a stable version, or a warm-start draft to publish as the first one:
`osd draft init` writes <state_dir>/drafts/v1, which `up` publishes and promotes when the
registry is empty. The trainer starts from the stable version and keeps its own lineage;
its candidates go through the canary. Everything stops in reverse order.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from pipeline.config import OSDConfig


def _log(msg: str) -> None:
    print(f"[osd up] {msg}", flush=True)


class UpError(RuntimeError):
    pass


def ensure_stable(cfg: OSDConfig, warm_start_dir: str | Path | None = None) -> str:
    """The stable version id, publishing and promoting the warm-start draft if the registry has none."""
    from pipeline.registry import Registry

    reg = Registry.from_config(cfg)
    stable = reg.alias("stable")
    if stable:
        return stable["version"]
    src = Path(warm_start_dir or Path(cfg.state_dir) / "drafts" / "v1")
    if not src.is_dir():
        raise UpError(f"the registry {reg.uri} has no stable draft and {src} does not exist; "
                      f"run `osd draft init` first (or `osd registry publish DIR` + `osd registry promote ID`)")
    existing = [v.id for v in reg.list()]
    version = reg.publish(src, "v1") if "v1" not in existing else reg.get("v1")
    reg.promote(version.id, reason="warm start")
    _log(f"published {src} as {version.id} and made it stable")
    return version.id


class ClosedLoop:
    """Serve + trainer + controller over one Ray, one Redis and one registry."""

    def __init__(self, cfg: OSDConfig, api_key: str | None = None, train: bool = True,
                 run_name: str | None = None):
        self.cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft": "registry"})})
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
        from pipeline.rollout import start_controller
        from serve.launch import LocalStack

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
        import ray

        from train.trainer import TrainerGroup

        run_dir = Path(self.cfg.state_dir) / "train" / self.run_name

        def loop() -> None:
            attempts = 0
            while not self._stopping.is_set():
                try:
                    self._trainer_group = TrainerGroup(self.cfg, run_dir, init_draft=f"registry:{stable}")
                    _log(f"trainer: {self._trainer_group.n} worker(s), ZeRO-{self.cfg.train.zero_stage}, "
                         f"from {stable}; a candidate every {self.cfg.train.export_every_records} records "
                         f"or {self.cfg.train.export_every_s:.0f} s")
                    self._trainer_group.run()
                    return
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    if self._stopping.is_set():
                        return
                    attempts += 1
                    self.trainer_error = f"{type(e).__name__}: {e}"
                    _log(f"a trainer worker failed; restarting from the last COMPLETE checkpoint ({attempts})")
                    if attempts > 5:
                        _log("trainer failed 5 times; serving and rollout go on without it")
                        return
                finally:
                    if self._trainer_group is not None and not self._stopping.is_set():
                        self._trainer_group.shutdown()
                        self._trainer_group = None

        self._trainer_thread = threading.Thread(target=loop, name="osd-trainer-group", daemon=True)
        self._trainer_thread.start()

    def stop_trainer(self) -> None:
        """Stop training (serving and rollout go on); the group's checkpoints stay."""
        self._stopping.set()
        group, self._trainer_group = self._trainer_group, None
        if group is not None:
            group.shutdown()
        if self._trainer_thread is not None:
            self._trainer_thread.join(timeout=60)

    def controller_status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.controller.status.remote(), timeout=30)

    def samples(self) -> list[dict[str, Any]]:
        import ray

        return ray.get(self.controller.samples.remote(), timeout=30)

    def stop(self) -> None:
        import ray

        try:
            self.stop_trainer()
        except Exception:
            pass
        if self.controller is not None:
            try:
                ray.get(self.controller.stop.remote(), timeout=30)
                ray.kill(self.controller)
            except Exception:
                pass
        if self.stack is not None:
            self.stack.stop()

    def __enter__(self) -> "ClosedLoop":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run_up(cfg: OSDConfig, api_key: str | None = None, train: bool = True) -> int:
    from serve.launch import wait_for_signal

    loop = ClosedLoop(cfg, api_key, train=train).start()
    print(f"osd is up: OpenAI-compatible API at {loop.url}/v1 (Ctrl-C to stop)\n"
          f"  registry: osd registry list   audit: {cfg.registry.uri or Path(cfg.state_dir) / 'registry'}/audit",
          flush=True)
    wait_for_signal()
    loop.stop()
    return 0
