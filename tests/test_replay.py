"""`osd replay` (pipeline/traffic/replay.py) and `osd bench stream`.

The HTTP tests run the client against a small aiohttp server started here on 127.0.0.1. It
stands in for the model server only so the client can be tested quickly and deterministically
(it answers in OpenAI shape, fails on purpose for marked prompts and counts records); the real
Ray Serve server has its own end-to-end tests. Nothing here asserts timings.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from pipeline.cli import main
from infra.config import OSDConfig
from infra.prompts import Prompt, PromptDataError, select_prompts
from infra.redis.server import free_port
from pipeline.traffic.replay import (
    BAD_RESPONSE,
    RequestResult,
    ReplayConnectionError,
    ReplayError,
    _error_message,
    arrival_times,
    build_body,
    compare_summary,
    percentile,
    run_replay,
    summarize,
)

CFG = OSDConfig()
pure = pytest.mark.pure


# -- the stand-in server ---------------------------------------------------------------------


class FakeServer:
    """OpenAI-shaped answers; "BAD" in a prompt -> 400, "BOOM" -> 500, "GARBAGE" -> 200 with a
    body that is not a completion. Records: every ok request whose osd_record is not false is
    written, or dropped if its prompt contains "DROP"."""

    def __init__(self, *, stats_route: bool = True, api_key: str | None = None):
        self.stats_route = stats_route
        self.api_key = api_key
        self.received: list[tuple[str, dict]] = []  # (path, body) in arrival order
        self.written = 100  # nonzero start: the client must report deltas, not totals
        self.dropped = 7
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _completion(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append((request.path, body))
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad api key", "type": "authentication_error",
                                                "param": None, "code": "invalid_api_key"}}, status=401)
        chat = request.path == "/v1/chat/completions"
        text = body["messages"][0]["content"] if chat else body["prompt"]
        if "BAD" in text:
            return web.json_response({"error": {"message": f"prompt rejected: {text}", "type": "invalid_request_error",
                                                "param": "messages", "code": None}}, status=400)
        if "BOOM" in text:
            return web.json_response({"error": {"message": "engine crashed", "type": "internal_error",
                                                "param": None, "code": None}}, status=500)
        if "GARBAGE" in text:
            return web.json_response({"hello": "world"})
        if body.get("osd_record", True):
            if "DROP" in text:
                self.dropped += 1
            else:
                self.written += 1
        n = min(body["max_tokens"], 2 + len(text.split()))
        choice = ({"index": 0, "message": {"role": "assistant", "content": "x " * n}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": "x " * n, "finish_reason": "length"})
        return web.json_response({
            "id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "model": "osd",
            "choices": [choice],
            "usage": {"prompt_tokens": len(text.split()), "completion_tokens": n,
                      "total_tokens": n + len(text.split())},
            "osd": {"draft_version": "v3", "acceptance_rate": 0.75, "mean_accepted_len": 2.0,
                    "num_draft_tokens": 8, "num_accepted_tokens": 6},
        })

    async def _stats(self, request: web.Request) -> web.Response:
        if not self.stats_route:
            raise web.HTTPNotFound()
        return web.json_response({"records_written": self.written, "records_dropped": self.dropped,
                                  "queued": 0})

    def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/osd/stats", self._stats)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None)
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FakeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def server():
    with FakeServer() as s:
        yield s


def prompts(*texts: str) -> list[Prompt]:
    return [Prompt(f"p{i}", t, "other", "held_out") for i, t in enumerate(texts)]


def replay(url: str, ps: list[Prompt], **kw):
    kw.setdefault("progress", False)
    kw.setdefault("timeout_s", 30)
    return run_replay(CFG, url, prompts=ps, log=lambda s: None, **kw)


# -- pure parts ------------------------------------------------------------------------------


@pure
def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 10, 101):
        xs = list(rng.random(n))
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5


def _res(i, ok=True, status="200", lat=1.0, tokens=10, mal=2.0, drafted=8, accepted=6, record=None, error=None):
    return RequestResult(i, record, ok, status, lat, completion_tokens=tokens if ok else 0,
                         mean_accepted_len=mal if ok else None, num_draft_tokens=drafted if ok else 0,
                         num_accepted_tokens=accepted if ok else 0, error=error)


@pure
def test_summarize_counts_percentiles_and_aggregates():
    lat = [0.1 * (i + 1) for i in range(10)]  # 0.1 .. 1.0 over the ok requests
    rs = [_res(i, lat=lat[i], tokens=10 if i % 2 else 30, mal=1.0 if i % 2 else 3.0, drafted=4, accepted=i % 3)
          for i in range(10)]
    rs += [_res(10, ok=False, status="400", lat=99, error="400 invalid_request_error: no"),
           _res(11, ok=False, status="400", lat=99), _res(12, ok=False, status="connect", lat=99)]
    s = summarize(rs, wall_s=4.0)
    assert (s["requests"], s["ok"], s["failed"]) == (13, 10, 3)
    assert s["failed_by_status"] == {"400": 2, "connect": 1}
    assert s["errors"] == ["400 invalid_request_error: no"]
    # Failed requests (latency 99) must not enter the percentiles.
    assert s["latency_p50_s"] == pytest.approx(np.percentile(lat, 50))
    assert s["latency_p99_s"] == pytest.approx(np.percentile(lat, 99))
    assert s["tokens"] == 200
    assert s["tok_s"] == pytest.approx(50.0)
    assert s["requests_per_s"] == pytest.approx(2.5)
    assert s["acceptance_rate"] == pytest.approx(sum(i % 3 for i in range(10)) / 40)
    # Steps: 5 x 30/3 + 5 x 10/1 = 100 for 200 tokens.
    assert s["mean_accepted_len"] == pytest.approx(200 / 100)
    # Aggregated over steps: 60/3 + 10/1 = 30 steps for 70 tokens; neither the plain mean (2.0)
    # nor the token-weighted mean (2.71) of the per-response values.
    s2 = summarize([_res(0, tokens=60, mal=3.0), _res(1, tokens=10, mal=1.0)], 1.0)
    assert s2["mean_accepted_len"] == pytest.approx(70 / 30)


@pure
def test_summarize_nothing_ok_gives_unknowns():
    s = summarize([_res(0, ok=False, status="500")], wall_s=1.0)
    assert s["ok"] == 0 and s["failed_by_status"] == {"500": 1}
    assert s["latency_p50_s"] is None and s["acceptance_rate"] is None and s["mean_accepted_len"] is None
    json.dumps(s, allow_nan=False)  # unknowns are null, not NaN


@pure
def test_compare_summary_is_median_of_pair_ratios():
    # Per prompt: (on, off). Ratios 1.1, 1.2, 1.0 -> median 1.1 -> +10 %. The ratio of the two
    # overall medians (2.2 / 2.0) happens to be the same here, so add a prompt that separates them.
    pairs = [(1.1, 1.0), (2.4, 2.0), (3.0, 3.0), (10.0, 5.0), (0.5, 1.0)]
    rs = []
    for i, (on, off) in enumerate(pairs):
        rs += [_res(i, lat=on, record=True), _res(i, lat=off, record=False)]
    rs.append(_res(9, lat=50.0, record=True))  # no partner: left out
    rs += [_res(8, lat=1.0, record=True), _res(8, ok=False, status="500", record=False)]  # partner failed
    c = compare_summary(rs)
    ratios = [a / b for a, b in pairs]
    assert c["pairs"] == 5
    assert c["record_path_overhead_pct"] == pytest.approx(100 * (float(np.median(ratios)) - 1))
    assert c["latency_p50_record_on_s"] == pytest.approx(2.4)
    assert c["latency_p50_record_off_s"] == pytest.approx(2.0)
    assert c["record_path_overhead_pct_of_medians"] == pytest.approx(20.0)
    assert compare_summary([])["record_path_overhead_pct"] is None


@pure
def test_build_body_shapes():
    b = build_body("hi", chat=True, max_tokens=5, temperature=0.5, record=None)
    assert b == {"model": "osd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                 "temperature": 0.5, "stream": False}
    b = build_body("hi", chat=False, max_tokens=5, temperature=0.0, record=False)
    assert b["prompt"] == "hi" and "messages" not in b and b["osd_record"] is False
    assert build_body("hi", chat=True, max_tokens=5, temperature=0.0, record=True)["osd_record"] is True


@pure
def test_error_message_from_openai_body_and_from_text():
    body = json.dumps({"error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": None}})
    assert _error_message(400, body) == "400 invalid_request_error: too long"
    assert _error_message(502, "<html>Bad Gateway</html>") == "502: <html>Bad Gateway</html>"


@pure
def test_arrival_times_seeded_poisson():
    a = arrival_times(2000, rate=10.0, seed=3)
    assert a == arrival_times(2000, rate=10.0, seed=3)
    assert a != arrival_times(2000, rate=10.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.1)  # 2000 exponential gaps: within 10 % of 1/rate
    assert np.std(gaps) == pytest.approx(0.1, rel=0.15)  # exponential: std == mean


@pure
def test_select_prompts_from_file(tmp_path):
    f = tmp_path / "p.jsonl"
    lines = [{"prompt": "write a poem about the sea"}, {"prompt": "def f(): return 1  # fix this python bug"},
             {"prompt": "write " + "x" * 2000}, {"prompt": "write an essay"}, {"prompt": "hello there"}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert [p.text for p in select_prompts(CFG.data, None, str(f), max_prompt_chars=1000)] == \
        [lines[i]["prompt"] for i in (0, 1, 3, 4)]
    got = select_prompts(CFG.data, None, str(f), domain="writing", max_prompt_chars=1000)
    assert [p.text for p in got] == [lines[0]["prompt"], lines[3]["prompt"]]
    assert len(select_prompts(CFG.data, 1, str(f), domain="writing")) == 1
    with pytest.raises(PromptDataError, match="unknown domain"):
        select_prompts(CFG.data, None, str(f), domain="poetry")
    # No length limit (how `osd bench engine` reads a prompts file): every line, in order.
    assert [p.text for p in select_prompts(CFG.data, None, str(f), max_prompt_chars=None)] == [x["prompt"] for x in lines]


@pure
def test_bad_parameters_are_replay_errors():
    ps = prompts("a")
    with pytest.raises(ReplayError, match="not both"):
        replay("http://127.0.0.1:1", ps, concurrency=2, rate=1.0)
    with pytest.raises(ReplayError, match="http"):
        replay("ftp://example", ps)
    with pytest.raises(ReplayError, match="no prompts"):
        replay("http://127.0.0.1:1", [])
    with pytest.raises(ReplayError, match="compare"):
        replay("http://127.0.0.1:1", ps, compare_recording=True, record=True)
    conv = [Prompt("c", "q2", "other", "held_out", (("user", "q1"), ("assistant", "a1"), ("user", "q2")))]
    with pytest.raises(ReplayError, match="chat completions"):
        replay("http://127.0.0.1:1", conv, chat=False)


@pure
def test_a_conversation_is_sent_whole_on_chat():
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert build_body("q2", chat=True, max_tokens=5, temperature=0.0, record=None, messages=msgs)["messages"] == msgs


@pure
def test_connection_refused_raises_clear_error():
    with pytest.raises(ReplayConnectionError, match="connection refused"):
        replay(f"http://127.0.0.1:{free_port()}", prompts("a"))


# -- against the stand-in server -------------------------------------------------------------


@pure
def test_closed_loop_counts_statuses_and_record_deltas(server, tmp_path):
    ps = prompts("hello world", "BAD one", "tell me more", "BOOM", "DROP this one", "BAD two", "GARBAGE", "fine")
    out = tmp_path / "r" / "replay.json"
    s = replay(server.url, ps, concurrency=3, max_tokens=5, json_path=out)
    assert len(server.received) == len(ps)
    assert sorted(b["messages"][0]["content"] for _, b in server.received) == sorted(p.text for p in ps)
    assert all(path == "/v1/chat/completions" and "osd_record" not in b for path, b in server.received)
    assert all(b["model"] == "osd" and b["max_tokens"] == 5 and b["stream"] is False for _, b in server.received)
    assert (s["ok"], s["failed"]) == (4, 4)
    assert s["failed_by_status"] == {"400": 2, "500": 1, BAD_RESPONSE: 1}
    assert any("prompt rejected: BAD" in e for e in s["errors"])
    assert s["records_written"] == 3 and s["records_dropped"] == 1
    # completion tokens: min(5, 2 + words) per ok prompt
    assert s["tokens"] == 4 + 5 + 5 + 3
    assert s["acceptance_rate"] == pytest.approx(0.75) and s["mean_accepted_len"] == pytest.approx(2.0)
    assert s["draft_versions"] == {"v3": 4}
    assert s["latency_p50_s"] is not None and s["latency_p50_s"] <= s["latency_p99_s"]
    assert s["params"]["concurrency"] == 3 and s["params"]["rate"] is None
    assert json.loads(out.read_text()) == json.loads(json.dumps(s))


@pure
def test_completions_endpoint_and_record_field(server):
    s = replay(server.url, prompts("one two", "three"), chat=False, record=False)
    assert s["ok"] == 2
    assert [path for path, _ in server.received] == ["/v1/completions"] * 2
    assert all(b["osd_record"] is False and "prompt" in b for _, b in server.received)
    assert s["records_written"] == 0 and s["records_dropped"] == 0


@pure
def test_compare_recording_sends_each_prompt_both_ways_alternating(server):
    ps = prompts("alpha a", "beta b", "gamma g", "delta d", "epsilon e")
    s = replay(server.url, ps, compare_recording=True)
    got = [(b["messages"][0]["content"], b["osd_record"]) for _, b in server.received]
    assert len(got) == 2 * len(ps)
    # Concurrency 1 by default, so arrival order is send order: each prompt's pair back to back,
    # the recorded one first for even prompts, second for odd ones.
    for i, p in enumerate(ps):
        first = i % 2 == 0
        assert got[2 * i: 2 * i + 2] == [(p.text, first), (p.text, not first)]
    assert s["params"]["concurrency"] == 1
    assert s["ok"] == 10 and s["compare"]["pairs"] == 5
    assert s["compare"]["record_path_overhead_pct"] is not None
    assert s["by_record"]["on"]["ok"] == 5 and s["by_record"]["off"]["ok"] == 5
    assert s["records_written"] == 5


@pure
def test_open_loop_is_bounded_by_prompt_count(server):
    ps = prompts(*[f"prompt {i}" for i in range(6)])
    s = replay(server.url, ps, rate=200.0, seed=1)
    assert len(server.received) == 6 and s["ok"] == 6 and s["not_sent"] == 0
    assert s["params"]["rate"] == 200.0 and s["params"]["concurrency"] is None


@pure
@pytest.mark.timeout(60)
def test_duration_stops_a_slow_open_loop(server):
    # Mean gap 100 s: without the duration bound this would run for minutes.
    s = replay(server.url, prompts("a", "b", "c", "d"), rate=0.01, duration_s=0.5)
    assert len(server.received) == 1 and s["ok"] == 1 and s["not_sent"] == 3


@pure
def test_missing_stats_route_reports_unknown_records():
    with FakeServer(stats_route=False) as srv:
        s = replay(srv.url, prompts("hello"))
    assert s["ok"] == 1
    assert s["records_written"] is None and s["records_dropped"] is None


@pure
def test_bearer_auth(monkeypatch):
    with FakeServer(api_key="sekret") as srv:
        monkeypatch.delenv("OSD_API_KEY", raising=False)
        s = replay(srv.url, prompts("a", "b"))
        assert s["failed_by_status"] == {"401": 2} and "bad api key" in s["errors"][0]
        monkeypatch.setenv("OSD_API_KEY", "sekret")
        assert replay(srv.url, prompts("a", "b"))["ok"] == 2
        monkeypatch.delenv("OSD_API_KEY")
        assert replay(srv.url, prompts("a"), api_key="sekret")["ok"] == 1


# -- the CLI ---------------------------------------------------------------------------------


def _prompts_file(tmp_path: Path, *texts: str) -> str:
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(f)


@pure
def test_cli_replay_writes_json(server, tmp_path, capsys):
    out = tmp_path / "replay.json"
    rc = main(["replay", "--url", server.url, "--prompts-file", _prompts_file(tmp_path, "a b", "BAD", "c"),
               "--concurrency", "2", "--max-tokens", "3", "--no-progress", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert (s["ok"], s["failed"], s["failed_by_status"]) == (2, 1, {"400": 1})
    assert s["params"]["max_tokens"] == 3
    table = capsys.readouterr().out
    assert "ok / failed" in table and "2 / 1" in table


@pure
def test_cli_compare_recording(server, tmp_path):
    out = tmp_path / "cmp.json"
    rc = main(["replay", "--url", server.url, "--prompts-file", _prompts_file(tmp_path, "a", "b", "c"),
               "--compare-recording", "--no-progress", "--json", str(out)])
    assert rc == 0
    assert sorted(b["osd_record"] for _, b in server.received) == [False] * 3 + [True] * 3
    assert json.loads(out.read_text())["compare"]["pairs"] == 3


@pure
def test_cli_connection_refused_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "replay.json"
    rc = main(["replay", "--url", f"http://127.0.0.1:{free_port()}", "--prompts-file",
               _prompts_file(tmp_path, "a"), "--no-progress", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("osd: error: cannot connect to http://127.0.0.1:") and "connection refused" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pure
def test_cli_concurrency_and_rate_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--concurrency", "2", "--rate", "1"])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.redis
@pytest.mark.parametrize("spool", [False, True])
def test_cli_bench_stream_small(tmp_path, capsys, spool):
    out = tmp_path / "stream.json"
    rc = main(["bench", "stream", "--records", "200", "--tokens", "32", "--top-k", "8", "--json", str(out)]
              + ["--spool"] * spool)
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["records"] == 200 and s["dropped"] == 0 and s["tokens"] == 32 and s["top_k"] == 8
    assert s["records_per_s"] > 0 and s["spool"] is spool and s["submit_us_p50"] > 0
    assert "records/s" in capsys.readouterr().out
