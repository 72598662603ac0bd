"""infra/common/reaper.py: what a process started is stopped when it is killed with SIGKILL, even
a grandchild that was orphaned (reparented away) before the kill."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.pure

OWNER = """
import subprocess, sys, time
from infra.common.reaper import Reaper
Reaper().start()
# An orphan, as Ray's agents become when the raylet dies: the middle process lives a while
# (the guard records it and its child), then exits and leaves its child to init.
mid = subprocess.Popen([sys.executable, "-c",
    "import subprocess, time; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); time.sleep(2.5)"],
    stdout=subprocess.PIPE, text=True)
print(mid.stdout.readline().strip(), flush=True)
mid.wait()
time.sleep(300)
"""


def test_sigkilled_owner_takes_its_orphans_along():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    orphan = psutil.Process(int(owner.stdout.readline()))
    try:
        mid = orphan.ppid()
        deadline = time.monotonic() + 20
        while orphan.ppid() == mid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert orphan not in psutil.Process(owner.pid).children(recursive=True)  # orphaned
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        orphan.wait(20)  # psutil: returns once the process is gone
    finally:
        if orphan.is_running():
            orphan.kill()
    assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE


def test_clean_close_ends_the_guard_and_spares_the_owners_children():
    """A clean stop is not a crash: the owner's other children (a test session's Redis) live on."""
    from infra.common.reaper import Reaper

    child = subprocess.Popen(["sleep", "300"])
    try:
        r = Reaper().start()
        guard = psutil.Process(r._guard.pid)
        time.sleep(1.5)  # the guard has recorded the child
        r.close()
        guard.wait(10)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
