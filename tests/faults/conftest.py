"""The fault-injection suite: real processes killed at named points (infra/common/faults.py), real
Redis stopped and killed under load, torn files and full disks; each test asserts what the
loop promises afterwards (docs/faults.md, "What survives what")."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.faults)


def run_killed(code: str, fault: str, args: dict, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `code` (a Python script that reads its arguments as JSON from argv[1]) in a fresh
    interpreter with OSD_FAULT=fault, and require that it died of SIGKILL at that point."""
    # One torch thread: the models are tiny and the cores shared; DeepSpeed on the CPU.
    env = {**os.environ, "OSD_FAULT": fault, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    p = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == -signal.SIGKILL, (
        f"expected a SIGKILL at {fault}, got rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p
