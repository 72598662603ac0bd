"""The private redis-server: it dies with its owner, a stale one is replaced, it is locked down."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from infra.config import OSDConfig, StreamConfig
from infra.redis.server import (RedisServer, RedisServerError, check_redis_url, find_redis_server, free_port,
                                   private_server, redact_url, server_maxmemory_mb)

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (it holds no port, no files)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not gone(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return gone(pid)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


OWNER = r"""
import sys, threading, time
from infra.redis.server import RedisServer
# Started from a thread that then ends: the server must still live as long as this process.
t = threading.Thread(target=lambda: print(RedisServer(sys.argv[1]).start().pid, flush=True))
t.start(); t.join()
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_server_dies_with_its_killed_owner(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "redis")], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(owner.stdout.readline())
        time.sleep(0.3)
        assert not gone(pid)  # the starting thread has ended; the server is still there
        owner.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the kernel can stop it now
        owner.wait()
        assert wait_gone(pid), f"redis-server {pid} outlived its SIGKILLed owner"
    finally:
        owner.kill()
        owner.wait()
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)  # do not leak it when the test fails


def test_server_whose_owner_died_is_replaced_on_the_same_data(tmp_path):
    old = RedisServer(tmp_path / "redis").start()
    try:
        url = old.url
        redis.Redis.from_url(url).xadd("s", {"k": "v"})
        info = json.loads(old.info_path.read_text())
        assert info["owner_pid"] == os.getpid()
        # As if the process that started it had been killed before it could stop it.
        old.info_path.write_text(json.dumps({**info, "owner_pid": dead_pid()}))

        new = RedisServer(tmp_path / "redis").start()
        assert new.owned and new.pid != old.pid  # replaced, not adopted
        assert old.proc.wait(10) == 0  # shut down cleanly (SHUTDOWN fsyncs the AOF)
        assert new.url == url  # same password, same port: clients reconnect unchanged
        assert redis.Redis.from_url(url).xlen("s") == 1  # nothing lost
        assert json.loads(new.info_path.read_text())["pid"] == new.pid
        new.stop()
    finally:
        old.stop()


def test_server_from_before_owners_and_passwords_is_replaced(tmp_path):
    """A server leaked by an older version (no password, server.json without an owner) is not
    adopted forever: it is shut down and a locked-down one takes over its data."""
    data = tmp_path / "redis"
    data.mkdir()
    port = free_port()
    legacy = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                               "--appendonly", "yes", "--save", ""], stdout=subprocess.DEVNULL)
    try:
        plain = redis.Redis(port=port)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                plain.xadd("s", {"k": "v"})
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        (data / "server.json").write_text(json.dumps({"pid": legacy.pid, "port": port}))
        with RedisServer(data) as new:
            assert new.owned and legacy.wait(10) == 0
            assert redis.Redis.from_url(new.url).xlen("s") == 1
    finally:
        legacy.kill()
        legacy.wait()


def test_data_dir_private_password_required_memory_bounded(tmp_path):
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)  # made before it was private: start() tightens it
    data.chmod(0o755)
    with RedisServer(data, maxmemory_mb=77) as server:
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.info_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(server.auth_path.stat().st_mode) == 0o600
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        r = redis.Redis.from_url(server.url)
        assert r.config_get("maxmemory")["maxmemory"] == str(77 * 1024 * 1024)
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert server.password not in repr(server)
        # Another process (here: another object) adopts it with the same URL, password included.
        other = RedisServer(data).start()
        assert other.url == server.url and not other.owned and other.running


def test_private_server_memory_follows_stream_budget(tmp_path):
    conf = OSDConfig(state_dir=tmp_path / "state", stream={"memory_budget_mb": 100, "lag_budget": 1000})
    server = private_server(conf)
    try:
        assert server.maxmemory_mb == server_maxmemory_mb(conf.stream) == 214  # 1.5 x 100 + 64
        assert redis.Redis.from_url(server.url).config_get("maxmemory")["maxmemory"] == str(214 * 1024 * 1024)
    finally:
        server.stop()
    assert server_maxmemory_mb(StreamConfig()) > StreamConfig().memory_budget_mb


def test_check_redis_url_one_clear_line(redis_server):
    check_redis_url(redis_server.url, 1.0)  # reachable: no error
    port = free_port()  # nothing listens there
    with pytest.raises(RedisServerError) as e:
        check_redis_url(f"redis://:hunter2@127.0.0.1:{port}/0", 0.5)
    msg = str(e.value)
    assert msg.startswith(f"cannot reach Redis at redis://127.0.0.1:{port}/0 (password hidden): ")
    assert "hunter2" not in msg and "\n" not in msg
    wrong = redis_server.url.replace(redis_server.password, "wrong")
    with pytest.raises(RedisServerError, match=r"\(password hidden\): .*(invalid|WRONGPASS)") as e:
        check_redis_url(wrong, 1.0)
    assert "wrong" not in str(e.value).split(": ", 1)[0]
    with pytest.raises(RedisServerError, match=r"^cannot reach Redis at http://h:1/: .*redis://"):
        check_redis_url("http://h:1/", 0.5)


def test_redact_url():
    assert redact_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("rediss://user:p%40ss@host/1") == "rediss://user:***@host/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"  # nothing to hide
    assert redact_url("unix://:pw@/tmp/redis.sock?db=0") == "unix://:***@/tmp/redis.sock?db=0"
    assert redact_url("not a url") == "not a url"
