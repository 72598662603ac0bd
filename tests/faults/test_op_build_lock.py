"""A trainer killed while DeepSpeed JIT-builds its CPU ops left torch's build lock (a plain
file, <TORCH_EXTENSIONS_DIR>/<op>/lock) behind, and every later trainer start waited on it for
ever in FileBaton.wait: found when test_trainer_kill.py hung after the whole-stack scenarios
had stopped a trainer mid-build. Builds now run under a kernel lock that dies with its holder,
and whoever holds it removes torch's leftover locks."""

import os
import signal
import subprocess
import sys

import pytest

from train.distill.ds_engine import op_build_lock

pytestmark = pytest.mark.pure

_BUILDER = """
import sys, time
from pathlib import Path
from train.distill.ds_engine import op_build_lock
with op_build_lock():
    Path(sys.argv[1], "fused_adam").mkdir(exist_ok=True)
    Path(sys.argv[1], "fused_adam", "lock").touch()  # what torch's FileBaton makes as it builds
    print("building", flush=True)
    time.sleep(600)
"""

_TRY_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as f:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(3)
"""


def test_a_killed_builder_s_lock_is_removed_by_the_next_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    builder = subprocess.Popen([sys.executable, "-c", _BUILDER, str(tmp_path)], stdout=subprocess.PIPE, env=env,
                               text=True)
    try:
        assert builder.stdout.readline().strip() == "building"
        # A live build holds the kernel lock: nobody else takes it, nor touches its torch lock.
        held = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(tmp_path / ".osd-build.lock")])
        assert held.returncode == 3 and (tmp_path / "fused_adam" / "lock").exists()
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    assert (tmp_path / "fused_adam" / "lock").exists()  # what torch would wait on for ever
    with op_build_lock():
        assert not (tmp_path / "fused_adam" / "lock").exists()
        held = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(tmp_path / ".osd-build.lock")])
        assert held.returncode == 3  # and this build holds it now


def test_a_fresh_dir_is_made_and_the_lock_released_on_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))
    for _ in range(2):  # the second entry finds it free: the first released it
        with op_build_lock():
            assert (tmp_path / "fresh" / ".osd-build.lock").exists()
    free = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(tmp_path / "fresh" / ".osd-build.lock")])
    assert free.returncode == 0
