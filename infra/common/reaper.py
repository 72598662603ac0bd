"""Nothing a local stack started outlives it, even when its process is killed with SIGKILL.

Ray's gcs and raylet share the fate of the driver that started them, but the agents the raylet
starts (dashboard agent, runtime-env agent) were seen to live on for minutes after a `kill -9`
of `osd serve`, reparented away from it. So the stack starts a small guard process first:
- every second it records the stack process's descendants (pid and start time), so it still
  knows them once they are orphaned;
- it holds the read end of a pipe whose write end only the stack's process has; when that
  process ends, in any way, the pipe reads EOF, and the guard stops every recorded process
  that is still the same process: SIGTERM (Redis flushes its AOF), SIGKILL after a grace;
- a clean stop writes "stand down" first: the stack has stopped its own processes, and the
  owner's other children (a test session's Redis) are not the guard's to stop.
A process started less than a second before a crash can escape; Ray starts nothing that late.

    python -m infra.common.reaper OWNER_PID      (stdin: the pipe; started by `Reaper.start`)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import psutil

STAND_DOWN = b"stand down\n"


def descendants(owner: int) -> dict[int, float]:
    """pid -> start time of every live descendant of `owner` (this guard excluded)."""
    try:
        procs = psutil.Process(owner).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            if p.pid != os.getpid():
                out[p.pid] = p.create_time()
        except psutil.NoSuchProcess:
            pass
    return out


def _same(pid: int, started: float) -> psutil.Process | None:
    """The process, if `pid` still names the one that started at `started` (pids get reused)."""
    try:
        p = psutil.Process(pid)
        return p if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def sweep(known: dict[int, float], grace_s: float = 5.0) -> list[int]:
    """Stop every recorded process that is still alive: SIGTERM, then SIGKILL after grace_s."""
    live = [p for p in (_same(pid, t) for pid, t in known.items()) if p is not None]
    for p in live:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(live, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in live]


class Reaper:
    """Start the guard for this process; `close()` on a clean stop."""

    def __init__(self) -> None:
        self._guard: subprocess.Popen | None = None

    def start(self) -> "Reaper":
        # A session of its own: a Ctrl-C at the terminal must not end the guard before the stack.
        self._guard = subprocess.Popen([sys.executable, "-m", "infra.common.reaper", str(os.getpid())],
                                       stdin=subprocess.PIPE, start_new_session=True)
        return self

    def close(self) -> None:
        """The stack stopped cleanly: the guard exits and stops nothing. (The owner may have
        children of its own that must live on, a test session's Redis for one.)"""
        if self._guard is not None and self._guard.stdin is not None:
            try:
                self._guard.stdin.write(STAND_DOWN)
            finally:
                self._guard.stdin.close()
            try:
                self._guard.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._guard.kill()
            self._guard = None


def guard(owner: int, poll_s: float = 1.0) -> list[int]:
    known: dict[int, float] = {}
    stdin = sys.stdin.buffer
    while True:
        known = {pid: t for pid, t in known.items() if psutil.pid_exists(pid)}  # forget the ended
        known.update(descendants(owner))
        ready, _, _ = select.select([stdin], [], [], poll_s)
        if not ready:
            continue
        data = os.read(stdin.fileno(), 4096)
        if STAND_DOWN in data:  # a clean stop: the owner stopped its stack itself
            return []
        if not data:  # EOF without a word: the owner died
            return sweep(known)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    guard(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
