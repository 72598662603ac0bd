"""A real Serve app for the server tests (test_serve_app, test_chaos_server)."""

import contextlib
import os


@contextlib.contextmanager
def running_app(data_dir, *, key: str, name: str, serve: dict, stream_name: str, extra: dict | None = None):
    """A real local Ray Serve app (tiny-random target) on a free loopback port, with its own
    redis-server, locked down as `osd serve` locks it (the key at Serve's proxy too). extra: more
    config overrides (top-level sections, e.g. state_dir for a registry)."""
    import ray
    from ray import serve as ray_serve

    from infra.config import load_config
    from infra.redis.server import RedisServer, free_port
    from pipeline.stack.launch import lock_down_local_cluster
    from serve.api.app import build_app

    redis_srv = RedisServer(data_dir).start()
    port = free_port()
    cfg = load_config(environ={}, overrides={
        "model": {"target": "tiny-random"}, "serve": {"port": port, **serve},
        "stream": {"redis_url": redis_srv.url, "stream": stream_name}, **(extra or {})})
    saved = dict(os.environ)
    lock_down_local_cluster(key, [k.model_dump() for k in cfg.serve.api_keys])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
        ray_serve.run(build_app(cfg, api_key=key), name=name, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "cfg": cfg, "redis": redis_srv}
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        redis_srv.stop()
        os.environ.clear()
        os.environ.update(saved)
