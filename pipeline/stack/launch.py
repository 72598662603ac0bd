"""`osd serve`: local Ray, a Redis for the record stream, and the Serve app, until Ctrl-C.

With `stream.redis_url` empty, a private redis-server is started under the state dir (AOF
on) and its URL is written into the config handed to the replicas, so every replica writes
to that one server. With RAY_ADDRESS set, it joins that cluster instead of starting one.

Start-up fails fast, with one line, on what would otherwise surface half a minute later as a
Ray traceback whose cause sits in Ray's log files: a Redis that does not answer, a draft spec
the target cannot take, a target that does not load (`preflight`).

HTTP: with the routes in the lone replica (serve.ingress and serve.http auto), the replica
answers on serve.port itself (Ray Serve's direct ingress) and Serve's proxy runs on a free port.

Exposure: the API key (OSD_API_KEY) guards every route but the health checks, at Serve's
proxy and at a replica's own port too (serve/api/proxy_auth.py), so Serve's own `/-/routes`
is covered. A local cluster keeps Ray's token authentication (on by default for local
clusters since Ray 2.5x) for its control ports; listening beyond loopback without a key is
warned about.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
from typing import Any

from infra.config import OSDConfig


class LaunchError(RuntimeError):
    """The stack cannot start with this configuration; the message says why in one line."""


def _log(msg: str) -> None:
    print(f"[osd] {msg}", file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def with_draft_resolved(cfg: OSDConfig) -> OSDConfig:
    """cfg with serve.draft: auto replaced by the draft it stands for, said once here, so every
    replica serves the same draft even if a warm start finishes while they start."""
    from serve.spec_decode.specs import DraftSpecError, resolve_auto

    try:
        spec, why = resolve_auto(cfg)
    except DraftSpecError as e:
        raise LaunchError(str(e)) from None
    if spec == cfg.serve.draft:
        return cfg
    _log(why)
    return cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"draft": spec})})


def preflight(cfg: OSDConfig) -> None:
    """Check in this process what the replicas would otherwise fail on inside Ray."""
    from infra.drafts.spec import REGISTRY_DRAFTS, DraftLoadError
    from infra.redis.server import RedisServerError, check_redis_url
    from infra.target import load_target, target_identity
    from serve.spec_decode.specs import DraftSpecError, build_draft

    if cfg.stream.redis_url:
        try:
            check_redis_url(cfg.stream.redis_url, cfg.stream.connect_timeout_s)
        except RedisServerError as e:
            raise LaunchError(f"{e} (stream.redis_url; leave it empty for a private redis-server)") from None
    loaded = load_target(cfg.model.target, cfg.model, progress=True)  # also converts the model once, here
    if cfg.serve.draft not in REGISTRY_DRAFTS:
        try:
            build_draft(cfg.serve.draft, loaded.model, target_sha256=target_identity(loaded))
        except (DraftSpecError, DraftLoadError, OSError, ValueError) as e:
            raise LaunchError(f"serve.draft {cfg.serve.draft!r}: {e}") from None


def lock_down_local_cluster(api_key: str | None, tenant_keys: list[dict] | None = None) -> None:
    """Before a local ray.init: the proxy, a child of the raylet started there, inherits the keys
    (OSD_API_KEY and serve.api_keys) and checks them on every route (serve/api/proxy_auth.py). Ray's
    control ports need no step here: Ray 2.60 turns its token authentication on for a local
    cluster unless RAY_AUTH_MODE says otherwise (set in the environment before it is imported,
    it would not apply to this process)."""
    import yaml

    from serve.api.proxy_auth import CALLBACK, CALLBACK_ENV, KEYS_ENV

    if api_key:
        os.environ["OSD_API_KEY"] = api_key
    if tenant_keys:
        os.environ.setdefault(KEYS_ENV, yaml.safe_dump(tenant_keys, default_flow_style=True))
    if api_key or tenant_keys:
        os.environ.setdefault(CALLBACK_ENV, CALLBACK)


def warn_if_exposed(cfg: OSDConfig, api_key: str | None) -> None:
    if not api_key and not cfg.serve.api_keys and not is_loopback(cfg.serve.host):
        _log(f"WARNING: listening on {cfg.serve.host}:{cfg.serve.port} beyond loopback with no API key: anyone "
             f"who can reach it can generate and write training records. Set OSD_API_KEY.")


def _deploy_error(e: Exception) -> str:
    """The one line that says why a deployment failed, out of Serve's multi-line report."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    causes = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
    return (causes or lines or [type(e).__name__])[-1][:500]


# How often `osd serve`/`osd up` look at their private redis-server, restarting it if it exited.
REDIS_WATCH_S = 1.0

# Ray Serve's direct ingress (serve.http "direct"), read by Serve's processes at start.
DIRECT_ENV = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
              "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "RAY_SERVE_PORT_QUARANTINE_S",
              "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")


def direct_http_env(cfg: OSDConfig, joining: bool) -> dict[str, str]:
    """The environment a local cluster starts with so that its lone replica answers HTTP on
    serve.port itself (serve.http direct, or auto with the routes in the replica); {} otherwise.
    Joining a running cluster, its processes' environment is already set: the proxy path is kept."""
    sv = cfg.serve
    if not sv.http_direct or joining:
        return {}
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # One port, serve.port: a replica that Serve starts again takes it back at once (no
        # quarantine), and a stopping one holds it no longer than its requests (no load
        # balancer in front needs time to stop sending to it).
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(sv.port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(sv.port + 1),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


class LocalStack:
    """Ray + Redis + the app, started in that order and stopped in reverse. A private
    redis-server that exits (a crash, the OOM killer) is started again on its port and data
    dir within REDIS_WATCH_S: the stack owns it, and nobody else would."""

    def __init__(self, cfg: OSDConfig, api_key: str | None = None, app_name: str = "osd"):
        self.cfg, self.api_key, self.app_name = cfg, api_key, app_name
        self.redis: Any = None
        self.reaper: Any = None
        self.redis_restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.url = f"http://{cfg.serve.host}:{cfg.serve.port}"

    def _watch_redis(self) -> None:
        from infra.redis.server import RedisServerError, exited, restart_private

        while not self._stopping.wait(REDIS_WATCH_S):
            server = self.redis
            if server is None or not exited(server):
                continue
            _log(f"the private redis-server exited (code {server.proc.returncode}); starting it again on port "
                 f"{server.port} from its append-only file")
            try:
                self.redis = restart_private(server)
                self.redis_restarts += 1
            except RedisServerError as e:  # tried again at the next look
                _log(f"restarting the private redis-server failed: {e}")

    def start(self) -> "LocalStack":
        import ray
        from ray import serve

        from infra.redis.server import private_server
        from serve.api.app import build_app

        from infra.common.reaper import Reaper

        cfg = self.cfg = with_draft_resolved(self.cfg)
        warn_if_exposed(cfg, self.api_key)
        preflight(cfg)
        self.reaper = Reaper().start()  # from here on, whatever starts dies with this process
        if not cfg.stream.redis_url:
            self.redis = private_server(cfg)
            cfg = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"redis_url": self.redis.url})})
            _log(f"private redis-server on 127.0.0.1:{self.redis.port} (data in {cfg.state_dir}/redis)")
            self._watcher = threading.Thread(target=self._watch_redis, name="osd-redis-watch", daemon=True)
            self._watcher.start()
        self.cfg = cfg
        address = os.environ.get("RAY_ADDRESS")
        _log("starting Ray" if not address else f"joining Ray at {address}")
        if not address:
            lock_down_local_cluster(self.api_key, [k.model_dump() for k in cfg.serve.api_keys])
        direct = direct_http_env(cfg, joining=bool(address))
        if address and cfg.serve.http_direct:
            _log("the replica answers HTTP itself only in a Ray cluster started here; joining one, HTTP goes "
                 "through Serve's proxy")
        for name in DIRECT_ENV:  # a stack started before in this process may have set them
            os.environ.pop(name, None)
        os.environ.update(direct)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        proxy_port = cfg.serve.port
        if direct:
            from infra.redis.server import free_port

            proxy_port = free_port()
            _log(f"the replica answers HTTP on port {cfg.serve.port} itself; Serve's proxy is on {proxy_port}")
        serve.start(http_options={"host": cfg.serve.host, "port": proxy_port})
        _log(f"deploying {cfg.serve.num_replicas} target replica(s) of {cfg.model.target} with draft {cfg.serve.draft}")
        try:
            serve.run(build_app(cfg, api_key=self.api_key), name=self.app_name, route_prefix="/")
        except RuntimeError as e:
            self.stop()
            raise LaunchError(f"the Serve app did not start: {_deploy_error(e)}") from None
        return self

    def stop(self) -> None:
        import ray
        from ray import serve

        self._stopping.set()  # before Redis stops, so it is not started again
        if self._watcher is not None:
            self._watcher.join(timeout=30)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if self.redis is not None:
                self.redis.stop()
            if self.reaper is not None:
                self.reaper.close()
                self.reaper = None

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def run_server(cfg: OSDConfig, api_key: str | None = None) -> int:
    stack = LocalStack(cfg, api_key).start()
    print(f"serving OpenAI-compatible API at {stack.url}/v1  (Ctrl-C to stop)", flush=True)
    print(f"  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 32}}'", flush=True)
    wait_for_signal()
    stack.stop()
    return 0


def wait_for_signal() -> None:
    """Block until Ctrl-C or SIGTERM (how `osd serve` and `osd up` run until stopped)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    _log("shutting down")
