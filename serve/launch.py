"""`osd serve`: local Ray, a Redis for the record stream, and the Serve app, until Ctrl-C.

With `stream.redis_url` empty, a private redis-server is started under the state dir (AOF
on) and its URL is written into the config handed to the replicas, so every replica writes
to that one server. With RAY_ADDRESS set, it joins that cluster instead of starting one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from pipeline.config import OSDConfig


def _log(msg: str) -> None:
    print(f"[osd] {msg}", file=sys.stderr, flush=True)


class LocalStack:
    """Ray + Redis + the app, started in that order and stopped in reverse."""

    def __init__(self, cfg: OSDConfig, api_key: str | None = None, app_name: str = "osd"):
        self.cfg, self.api_key, self.app_name = cfg, api_key, app_name
        self.redis: Any = None
        self.url = f"http://{cfg.serve.host}:{cfg.serve.port}"

    def start(self) -> "LocalStack":
        import ray
        from ray import serve

        from pipeline.redis_server import private_server
        from serve.app import build_app

        cfg = self.cfg
        if not cfg.stream.redis_url:
            self.redis = private_server(cfg)
            cfg = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"redis_url": self.redis.url})})
            _log(f"private redis-server at {self.redis.url} (data in {cfg.state_dir}/redis)")
        self.cfg = cfg
        address = os.environ.get("RAY_ADDRESS")
        _log("starting Ray" if not address else f"joining Ray at {address}")
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
        _log(f"deploying {cfg.serve.num_replicas} target replica(s) of {cfg.model.target} "
             f"with draft {cfg.serve.draft} (first start converts the model; later ones load from cache)")
        serve.run(build_app(cfg, api_key=self.api_key), name=self.app_name, route_prefix="/")
        return self

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if self.redis is not None:
                self.redis.stop()

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
