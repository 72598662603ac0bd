"""`osd serve` as a user runs it, in its own process (its own Ray, its own private Redis).

A separate module from test_serve_app so that module's Ray is shut down before this starts.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_osd_serve_cli_starts_and_stops(tmp_path):
    """`osd serve` as a user runs it: prints the URL, answers, exits cleanly on SIGINT."""
    from pipeline.redis_server import free_port

    port = free_port()
    env = {"OSD_MODEL__TARGET": "tiny-random", "OSD_SERVE__DRAFT": "none", "OSD_STATE_DIR": str(tmp_path),
           "PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("serving OpenAI-compatible API at "):
                url = line.split()[4].removesuffix("/v1")
        assert url == f"http://127.0.0.1:{port}", "".join(lines[-20:])
        r = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["osd"]["draft_version"] == "none"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
