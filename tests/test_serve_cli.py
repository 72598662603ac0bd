"""`osd serve` as a user runs it, in its own process (its own Ray, its own private Redis).

A separate module from test_serve_app so that module's Ray is shut down before this starts.
Issue 18: no process outlives `osd serve`, whether it stops on Ctrl-C or is killed with
`kill -9`; and a misconfiguration fails at once with one line, not a Ray traceback.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def serve_env(tmp_path, **extra) -> dict:
    """The environment of `osd serve`; a variable given as None is left out."""
    env = {"OSD_MODEL__TARGET": "tiny-random", "OSD_SERVE__DRAFT": "none", "OSD_STATE_DIR": str(tmp_path),
           "PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1", **extra}
    return {k: v for k, v in env.items() if v is not None}


def start_serve(tmp_path, *args, **env):
    """Start `osd serve`; returns (process, url, every process it started)."""
    from infra.redis.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port), *args],
                            env=serve_env(tmp_path, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, lines = None, []
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("serving OpenAI-compatible API at "):
            url = line.split()[4].removesuffix("/v1")
    if url != f"http://127.0.0.1:{port}":
        proc.kill()
        pytest.fail("osd serve did not start:\n" + "".join(lines[-20:]))
    proc.startup_lines = lines
    return proc, url, psutil.Process(proc.pid).children(recursive=True)


def stop_serve(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def assert_all_gone(procs, within_s: float = 60) -> None:
    def alive(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = [f"{p.pid} {p.name()}" for p in left if alive(p)]
    for p in left:  # leave nothing behind for the next test, whatever the verdict
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not names, f"processes outlived osd serve: {names}"


def test_kill_9_of_osd_serve_leaves_no_process(tmp_path):
    """Issue 18, defect 8: after kill -9 the private redis-server used to live on, unowned."""
    proc, url, started = start_serve(tmp_path)
    assert requests.get(url + "/healthz", timeout=30).status_code == 200
    r = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["osd"]["draft_version"] == "none"  # serve.draft none
    proc.kill()
    proc.wait(timeout=30)
    assert_all_gone(started)


def test_osd_serve_starts_serves_the_suffix_draft_by_default_and_stops_leaving_nothing(tmp_path, tiny):
    """`osd serve` as a user runs it: prints the URL, answers, exits cleanly on SIGINT, and every
    process it started (Ray, Serve's actors, its private Redis) is gone. With no --draft and no
    serve.draft it serves the suffix draft (chosen by measurement), and says how to serve the
    head `osd draft init --family head` published. One start for both: each costs a Ray and a
    Serve start."""
    from infra.drafts.head import build_head, save_head
    from infra.drafts.spec import DraftSpec

    head = save_head(build_head(tiny.model, DraftSpec(family="head")), tmp_path / "drafts" / "head-v1",
                     target_ref={"spec": "tiny-random"})
    proc, url, started = start_serve(tmp_path, OSD_SERVE__DRAFT=None)
    assert any(p.name() == "redis-server" for p in started)
    try:
        assert any("serve.draft auto: suffix" in ln and f"the warm-started draft {head}" in ln
                   and "--draft head+suffix" in ln for ln in proc.startup_lines)
        r = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["osd"]["draft_version"] == "suffix"
    finally:
        stop_serve(proc)
    assert proc.returncode == 0
    assert_all_gone(started)


def _listener(port: int) -> psutil.Process:
    (conn,) = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return psutil.Process(conn.pid)


def test_with_http_direct_the_replica_answers_on_the_port_itself_and_again_after_kill_9(tmp_path):
    """serve.http direct: the port `osd serve` prints is the replica's own HTTP server, not
    Serve's proxy; when the replica is killed, Serve's new replica takes the same port back."""
    proc, url, started = start_serve(tmp_path, OSD_SERVE__HTTP="direct")
    port = int(url.rsplit(":", 1)[1])
    try:
        assert any("answers HTTP on port" in ln for ln in proc.startup_lines)
        replica = _listener(port)
        assert "TargetReplica" in " ".join(replica.cmdline())
        r = requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        replica.kill()
        deadline = time.monotonic() + 90
        while True:
            try:
                if requests.get(url + "/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "no replica answered on the port after the kill"
            time.sleep(1)
        again = _listener(port)
        assert again.pid != replica.pid and "TargetReplica" in " ".join(again.cmdline())
        assert requests.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60).ok
        started.append(again)
    finally:
        stop_serve(proc)
    assert proc.returncode == 0
    assert_all_gone(started)


@pytest.mark.parametrize("args,env,expect", [
    (["--draft", "truncate:99"], {}, "serve.draft 'truncate:99'"),
    ([], {"OSD_STREAM__REDIS_URL": "redis://127.0.0.1:1/0"}, "cannot reach Redis"),
    ([], {"OSD_STREAM__REDIS_URL": "http://127.0.0.1:6379"}, "stream.redis_url"),
], ids=["draft-too-deep", "redis-unreachable", "redis-url-not-redis"])
def test_misconfiguration_fails_fast_with_one_line(tmp_path, args, env, expect):
    """Issue 18, defect 10: these used to fail after 35-39 s inside Ray, or print nothing at all."""
    from infra.redis.server import free_port

    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(free_port()), *args],
                          env=serve_env(tmp_path, **env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("osd: error")]
    assert len(errors) == 1 and expect in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "ray" not in proc.stderr.lower()
