import pytest


@pytest.fixture(scope="session")
def tiny():
    """One tiny random target for the whole session (built in-process, ~0.2 s)."""
    from infra.target import load_target

    return load_target("tiny-random", progress=False)


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory):
    """A saved one-layer draft of the tiny target (test_registry.py keeps its own, with lineage)."""
    from infra.drafts.layer import DraftSpec, build_draft, save_draft

    spec = DraftSpec(num_layers=1)
    out = tmp_path_factory.mktemp("drafts") / "d"
    save_draft(build_draft(tiny.model, spec), spec, out, target_ref={"spec": "tiny-random"})
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: per-op thread hand-off costs more than the math (5x on 2 cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One private redis-server (AOF on, free loopback port) for the `redis` tests of a session."""
    from infra.redis.server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url




def pytest_sessionfinish(session, exitstatus):
    """Name the threads still alive when the suite ends: one of them running native code while
    the interpreter shuts down is the usual cause of a crash after the last test passed."""
    import threading

    import sys

    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        names = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in alive)
        session.config.get_terminal_writer().line(f"threads alive at the end of the session: {names}")
    # Runtimes a test may have left up stop here, while the interpreter is whole, not in its
    # teardown, where their native threads would outlive the modules they call into.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
