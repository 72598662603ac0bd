import os

import pytest

# `make test` runs the suite on every core with pytest-xdist (`-n auto --dist loadgroup`).
# - The tests that start a local Ray cluster are two groups, each run by one worker in order, so
#   at most two clusters run at once: the whole-loop tests (Ray and DeepSpeed), and the rest.
# - Those groups are the longest, and mostly wait on their services, so they start first.
# - Every other test runs with the rest of its module, so a module's fixtures are built once.
# - One worker more than the cores: about half the suite's time is spent waiting on services.
RAY_GROUPS = ("ray-loop", "ray-serve")


def xdist_group_of(item) -> str:
    if item.get_closest_marker("ray"):
        return RAY_GROUPS[0] if item.get_closest_marker("deepspeed") else RAY_GROUPS[1]
    return item.nodeid.split("::", 1)[0]


def pytest_itemcollected(item):
    """Each test's xdist group, as it is collected (before xdist reads the groups)."""
    item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))


def pytest_xdist_auto_num_workers(config):
    return len(os.sched_getaffinity(0)) + 1


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class RayFirst(LoadGroupScheduling):
        def _assign_work_unit(self, node):
            for group in reversed(RAY_GROUPS):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    return RayFirst(config, log)


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
