"""In-cluster entry points: the two Serve applications a KubeRay RayService runs (helm/osd).

    serveConfigV2
      ├─ app "osd"       pipeline.stack.cluster:serving_app -> serve.api.app.build_app (ingress + target
      │                                                        replicas, drafts following the registry aliases)
      └─ app "osd-loop"  pipeline.stack.cluster:loop_app    -> LoopSupervisor (one replica): the warm start
                                                               when the registry has no stable draft, then
                                                               the rollout controller and the trainer group

Why the trainer and the controller live in a Serve application and not in a RayJob: Serve keeps
the application running (its health check restarts a supervisor whose controller is gone),
KubeRay reports it in the RayService status beside serving, `helm install` creates both at once,
and a new cluster made by an upgrade gets its own copy. A RayJob ends when its entrypoint does,
and one pointed at the RayService's cluster would stay behind on the old cluster after a
NewCluster upgrade.

The arguments (serveConfigV2 `args`) are checked here before anything starts: `config` is an
override tree over $OSD_CONFIG (the chart's ConfigMap) and the OSD_* environment, validated by
OSDConfig, so a bad value fails the deploy naming the field. Settings changed often (rollout
thresholds) go there: a new `args` redeploys one application, and the cluster stays.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra.config import ConfigError, OSDConfig, load_config
from infra.drafts.spec import DRAFT_FAMILIES, loop_draft

LOOP_RUN_NAME = "cluster"


class ClusterArgsError(ValueError):
    """The serveConfigV2 args of an application are invalid; the message says which and why."""


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Overrides over $OSD_CONFIG + OSD_* environment, the same tree as the YAML config.
    config: dict[str, Any] = Field(default_factory=dict)


class LoopArgs(AppArgs):
    # Trainer checkpoints live under <state_dir>/train/<run_name>: a restarted supervisor with
    # the same name resumes from the last COMPLETE one.
    run_name: str = Field(LOOP_RUN_NAME, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    train: bool = True
    # With no stable draft in the registry, make v1 in the cluster (`osd draft init`) first,
    # of this family: the head by default, as `osd draft init` (infra.drafts.spec.PREFERRED_FAMILIES).
    warm_start: bool = True
    warm_start_family: Literal[DRAFT_FAMILIES] = "head"


def _parse(model: type[AppArgs], args: Mapping[str, Any] | None, environ: Mapping[str, str] | None,
           app: str) -> tuple[Any, OSDConfig]:
    try:
        parsed = model.model_validate(dict(args or {}))
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '<root>'}: "
                 f"{'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}" for err in e.errors()]
        raise ClusterArgsError(f"invalid args for the {app} application:\n" + "\n".join(lines)) from None
    try:
        cfg = load_config(environ=environ, overrides=parsed.config)
    except ConfigError as e:
        raise ClusterArgsError(f"{app} application: {e}") from None
    # In a cluster every pod must reach the same stream and the same registry; the local
    # fallbacks (a private redis-server, a registry under a relative state_dir) would split them.
    if not cfg.stream.redis_url:
        raise ClusterArgsError(f"{app} application: stream.redis_url is empty; in a cluster it must name the "
                               f"shared Redis (the chart sets OSD_STREAM__REDIS_URL)")
    if not cfg.registry.uri:
        raise ClusterArgsError(f"{app} application: registry.uri is empty; in a cluster it must name storage "
                               f"every pod reaches (file:// on a ReadWriteMany volume, s3://, gs://)")
    # The closed loop serves what the registry's aliases say (as `osd up` does).
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft": loop_draft(cfg.serve.draft)})})
    return parsed, cfg


def serving_config(args: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> OSDConfig:
    """The validated config of the serving application (no Ray needed)."""
    return _parse(AppArgs, args, environ, "osd")[1]


def loop_config(args: Mapping[str, Any] | None,
                environ: Mapping[str, str] | None = None) -> tuple[LoopArgs, OSDConfig]:
    """The validated args and config of the loop application (no Ray needed)."""
    return _parse(LoopArgs, args, environ, "osd-loop")


def serving_app(args: dict[str, Any]) -> Any:
    """Serve application builder (serveConfigV2 import_path) for the OpenAI endpoint."""
    from serve.api.app import build_app

    # The key comes from OSD_API_KEY on the pods (the chart's Secret), as for `osd serve`.
    return build_app(serving_config(args))


def loop_app(args: dict[str, Any]) -> Any:
    """Serve application builder for the trainer and the rollout controller (module doc)."""
    from ray import serve

    parsed, cfg = loop_config(args)
    deployment = serve.deployment(LoopSupervisor, name="LoopSupervisor").options(
        # One supervisor: two would run two trainer groups as the same consumers. It holds no
        # CPU itself; the trainer workers ask for theirs and for train.resources.
        num_replicas=1, ray_actor_options={"num_cpus": 0}, health_check_period_s=30,
        health_check_timeout_s=60)
    return deployment.bind(parsed.model_dump(), cfg.model_dump(mode="json"))


def _warm_start_and_promote(cfg_dict: dict[str, Any], family: str = "head") -> str:
    """On a trainer node: make v1 of `family` (skipped when a retry finds it made) and make it
    stable. The head takes `osd draft init --family head`'s defaults."""
    from pipeline.teacher.engine import teacher_for
    from pipeline.stack.up import ensure_stable
    from infra.drafts.spec import warm_start_path
    from train.warm.layer import warm_start_family

    cfg = OSDConfig.model_validate(cfg_dict)
    out = warm_start_path(cfg, family)
    warm_start_family(cfg, family, out_dir=out, progress=False, generate=teacher_for(cfg))
    return ensure_stable(cfg, out)


def _restart_controller(cfg: OSDConfig) -> Any:
    """A controller with this config: one left by an earlier supervisor has the old one, so it
    is replaced (its state is in the registry, the new one carries on)."""
    import time

    import ray

    from pipeline.rollout.controller import CONTROLLER_NAME, start_controller

    try:
        ray.kill(ray.get_actor(CONTROLLER_NAME), no_restart=True)
    except ValueError:
        pass  # none running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the name is freed shortly after the kill
        try:
            ray.get_actor(CONTROLLER_NAME)
        except ValueError:
            break
        time.sleep(0.5)
    return start_controller(cfg)


class LoopSupervisor:
    """Warm start if needed, then the rollout controller and the trainer group, in a thread."""

    def __init__(self, args_dict: dict[str, Any], cfg_dict: dict[str, Any]):
        self.args = LoopArgs.model_validate(args_dict)
        self.cfg = OSDConfig.model_validate(cfg_dict)
        self.phase, self.stable, self.error = "starting", None, None
        self.trainer_error: str | None = None
        self.controller: Any = None
        self._group: Any = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="osd-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from pipeline.stack.up import UpError, ensure_stable, failure_reason, supervise

        try:
            try:
                self.stable = ensure_stable(self.cfg)
            except UpError:
                if not self.args.warm_start:
                    raise
                self.phase = "warm-start"
                self.stable = self._remote_warm_start()
            self.phase = "controller"
            self.controller = _restart_controller(self.cfg)
            self.phase = "running" if self.args.train else "running (no trainer)"
            if self.args.train:
                supervise(self._train_once, self._stopping)
        except Exception as e:  # reported by check_health, so Serve restarts the supervisor
            self.error = failure_reason(e)

    def _remote_warm_start(self) -> str:
        import ray

        env = {"env_vars": {"DS_ACCELERATOR": "cpu"}} if self.cfg.train.device == "cpu" else {}
        task = ray.remote(num_cpus=1, resources=dict(self.cfg.train.resources), max_retries=0)(
            _warm_start_and_promote)
        return ray.get(task.options(runtime_env=env).remote(self.cfg.model_dump(mode="json"),
                                                            self.args.warm_start_family))

    def _train_once(self) -> None:
        from pipeline.stack.up import failure_reason
        from pipeline.teacher.served_forward import served_forward
        from train.online.trainer import TrainerGroup

        run_dir = Path(self.cfg.state_dir) / "train" / self.args.run_name
        try:
            self._group = TrainerGroup(self.cfg, run_dir, init_draft=f"registry:{self.stable}", served=served_forward)
            self._group.run()
        except Exception as e:
            self.trainer_error = failure_reason(e)
            raise
        finally:
            group, self._group = self._group, None
            if group is not None:
                group.shutdown()

    def status(self) -> dict[str, Any]:
        return {"phase": self.phase, "stable": self.stable, "error": self.error,
                "trainer_error": self.trainer_error, "run_name": self.args.run_name}

    def check_health(self) -> None:
        """Serve restarts the supervisor when this raises: it failed, or its controller is gone."""
        import ray

        if self.error:
            raise RuntimeError(f"the loop failed in phase {self.phase}: {self.error}")
        if self.controller is not None:
            ray.get(self.controller.ready.remote(), timeout=30)

    async def __call__(self, request: Any) -> dict[str, Any]:
        return self.status()

    def __del__(self) -> None:
        self._stopping.set()
        group, self._group = getattr(self, "_group", None), None
        if group is not None:
            group.shutdown()
