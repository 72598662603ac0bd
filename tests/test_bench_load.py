"""`osd bench load` against a real server (tiny target): streaming levels with speculation on
and off, TTFT/ITL, tokens per target forward from the server's batch counters, JSON and PNG;
bad arguments and an unreachable server get clear errors."""

import json

import pytest
import requests
from apps import running_app

from pipeline.bench.load import LoadBenchError, load_prompts, ratios, run_load_bench

pytestmark = [pytest.mark.ray, pytest.mark.redis]

KEY = "bench-load-key"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    serve = {"draft": "truncate:1", "max_new_tokens": 16, "k": 2, "max_concurrency": 4, "prefill_chunk": 16}
    with running_app(tmp_path_factory.mktemp("bench-load-redis"), key=KEY, name="osd-bench-load", serve=serve,
                     stream_name="test:bench-load") as app:
        yield app


def test_a_sweep_streams_both_modes_and_writes_json_and_a_chart(app, tmp_path):
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    prompts = [f"prompt number {i} about batching" for i in range(8)]
    res = run_load_bench(app["url"], api_key=KEY, levels=(1, 3), seconds=2.0, max_tokens=6, speculation="both",
                         prompts=prompts, json_path=out, png_path=png)
    assert json.loads(out.read_text())["levels"] == res["levels"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [(r["concurrency"], r["speculation"]) for r in res["levels"]] == [(1, True), (1, False), (3, True),
                                                                            (3, False)]
    for r in res["levels"]:
        assert r["ok"] > 0 and r["errors"] == 0 and r["timeouts"] == 0, r
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["completion_tok_per_s"] > 0
        assert r["tokens_per_forward"] > 0
    assert set(res["ratios"]["spec_on_vs_off"]) == {"1", "3"}
    stats = requests.get(app["url"] + "/osd/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert stats["target_forwards"] > 0 and stats["target_rows"] >= stats["target_forwards"]


def test_ratios_are_taken_within_one_run():
    rows = [{"concurrency": c, "speculation": s, "completion_tok_per_s": tps, "itl_p50_ms": p50, "itl_p99_ms": p99}
            for c, s, tps, p50, p99 in ((1, True, 10.0, 20.0, 30.0), (1, False, 8.0, 25.0, 40.0),
                                        (8, True, 50.0, 30.0, 60.0), (8, False, 48.0, 30.0, 50.0))]
    r = ratios(rows)
    assert r["throughput_vs_1"]["8/on"] == 5.0 and r["throughput_vs_1"]["8/off"] == 6.0
    assert r["spec_on_vs_off"] == {"1": 10.0 / 8.0, "8": 50.0 / 48.0}
    assert r["itl_p99_vs_p50_at_1"]["8/on"] == 3.0


def test_bad_arguments_and_a_dead_server_are_clear_errors(tmp_path):
    with pytest.raises(LoadBenchError, match="speculation"):
        run_load_bench("http://127.0.0.1:9", speculation="sometimes")
    with pytest.raises(LoadBenchError, match="levels"):
        run_load_bench("http://127.0.0.1:9", levels=(0,))
    with pytest.raises(LoadBenchError, match="cannot reach"):
        run_load_bench("http://127.0.0.1:9", levels=(1,), seconds=0.1)
    with pytest.raises(LoadBenchError, match="cannot read prompts"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_the_long_prompt_probe_measures_the_streams_gaps_around_a_prefill(app):
    from pipeline.bench.load import long_prompt_probe

    r = long_prompt_probe(app["url"], {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                          streams=2, prompt_words=40, max_tokens=16, timeout_s=60)
    assert r["long_status"] == 200 and r["long_ttft_ms"] > 0 and set(r["stream_statuses"]) == {"200"}
    assert r["gap_before_p50_ms"] > 0


def test_a_request_count_sends_each_mode_the_same_requests_after_an_untimed_warm_up(monkeypatch):
    """--requests N: every client sends exactly N requests, and both modes send the same
    prompts, however fast each answers (a fake server: the faster mode would walk further
    down the prompts in a fixed time); each level's prompts are new, and speculation on runs
    first at every level (second, it would meet the server's answers to its prompts in the
    suffix pool). Before the levels: one
    request per mode on a prompt no level sends, then the longest prompt the server accepts,
    without speculation (the fake server refuses the longest one)."""
    import threading
    import time

    import pipeline.bench.load as load

    sent, mu = [], threading.Lock()

    def fake_send(session, url, headers, body, timeout_s):
        msg = json.loads(body)
        if msg["osd_speculate"]:
            time.sleep(0.001)  # one mode answers faster than the other
        text = msg["messages"][0]["content"]
        with mu:
            sent.append((msg["osd_speculate"], text))
        if text == longest:
            return load.Outcome(400, 0.001)  # past the server's context
        return load.Outcome(200, 0.01, completion_tokens=4, ttft_s=0.005)

    monkeypatch.setattr(load, "send_chat", fake_send)
    monkeypatch.setattr(load, "preflight", lambda url, headers: None)
    monkeypatch.setattr(load, "server_forwards", lambda url, headers: None)
    prompts = [f"prompt {i}" + "x" * (i % 7) for i in range(50)]
    longest = prompts[40] = "a prompt too long for the server's context"
    next_longest = max((p for p in prompts if p != longest), key=len)
    res = run_load_bench("http://fake", levels=(3, 2), requests=5, prompts=prompts, speculation="both")
    assert [(r["concurrency"], r["speculation"], r["requests"], r["ok"]) for r in res["levels"]] == [
        (3, True, 15, 15), (3, False, 15, 15), (2, True, 10, 10), (2, False, 10, 10)]
    assert res["requests_per_client"] == 5 and res["seconds_per_level"] is None
    warm, sent = sent[:4], sent[4:]
    assert warm == [(True, load.WARM_PROMPT), (False, load.WARM_PROMPT), (False, longest), (False, next_longest)]
    assert load.WARM_PROMPT not in prompts
    by_level = [sent[:30], sent[30:]]
    for part, n in zip(by_level, (15, 10)):
        on = sorted(p for s, p in part if s)
        assert on == sorted(p for s, p in part if not s) and len(on) == n
    assert not {p for _, p in by_level[0]} & {p for _, p in by_level[1]}
    with pytest.raises(LoadBenchError, match="requests"):
        run_load_bench("http://fake", levels=(1,), requests=0)


def test_timed_levels_send_new_prompts_and_both_modes_of_a_level_the_same_ones(monkeypatch):
    """With a fixed time, each level takes prompts no earlier level took, and its two modes
    take them from the same place in the list, speculation on first (the suffix pool would
    answer its repeat from memory; plain decoding drafts nothing); a list too short wraps, and
    the repeats are reported."""
    import threading
    import time

    import pipeline.bench.load as load

    sent, mu = [], threading.Lock()

    def fake_send(session, url, headers, body, timeout_s):
        time.sleep(0.002)
        msg = json.loads(body)
        if msg.get("cache_salt"):  # a timed request (the warm-up sends no salt)
            with mu:
                sent.append((msg["osd_speculate"], int(msg["messages"][0]["content"].split()[1])))
        return load.Outcome(200, 0.002, completion_tokens=2, ttft_s=0.001)

    monkeypatch.setattr(load, "send_chat", fake_send)
    monkeypatch.setattr(load, "preflight", lambda url, headers: None)
    monkeypatch.setattr(load, "server_forwards", lambda url, headers: None)
    many = [f"prompt {i}" for i in range(100_000)]
    # Windows far longer than the counts asked of them need (about 2 ms a request): a loaded CI
    # host once fitted 5 requests into 0.1 s.
    res = run_load_bench("http://fake", levels=(1, 3), seconds=0.5, prompts=many, speculation="both")
    rows = res["levels"]
    assert [(r["concurrency"], r["speculation"]) for r in rows] == [(1, True), (1, False), (3, True), (3, False)]
    assert len(sent) == res["prompts_sent"] == sum(r["requests"] for r in rows) > 20
    parts, at = [], 0
    for r in rows:
        parts.append(sent[at:at + r["requests"]])
        at += r["requests"]
    assert all(spec == r["speculation"] for part, r in zip(parts, rows) for spec, _ in part)
    taken = [sorted(i for _, i in part) for part in parts]
    for on, off in (taken[:2], taken[2:]):  # a level's modes: the same prompts, as far as both went
        n = min(len(on), len(off))
        assert on[:n] == off[:n] and on == list(range(on[0], on[0] + len(on)))
    first_level = max(taken[0][-1], taken[1][-1])
    assert taken[0][0] == 0 and taken[2][0] == taken[3][0] == first_level + 1  # the next level's are new
    assert res["distinct_prompts"] == max(taken[2][-1], taken[3][-1]) + 1 and res["repeated_prompts"] == 0
    sent.clear()
    few = many[:7]
    res = run_load_bench("http://fake", levels=(2,), seconds=0.5, prompts=few, speculation="on")
    assert res["prompts_sent"] == len(sent) > 7 and res["repeated_prompts"] == len(sent) - 7
    assert {i for _, i in sent} == set(range(7)) and res["distinct_prompts"] == 7


def test_a_conversation_sends_its_second_turn_with_the_servers_answer_and_each_mode_its_salt(monkeypatch):
    """--workload multiturn: the second turn carries the first turn and the server's streamed
    answer to it; a level reports the time to first token per turn; the two speculation modes
    send different cache salts, so neither finds the other's prompts cached."""
    import threading

    import pipeline.bench.load as load

    sent, mu = [], threading.Lock()

    def fake_send(session, url, headers, body, timeout_s):
        msg = json.loads(body)
        with mu:
            sent.append(msg)
        turn = (len(msg["messages"]) - 1) // 2
        return load.Outcome(200, 0.01, completion_tokens=3, ttft_s=0.002 if turn else 0.004,
                            text=f"answer to {msg['messages'][-1]['content']}")

    monkeypatch.setattr(load, "send_chat", fake_send)
    monkeypatch.setattr(load, "preflight", lambda url, headers: None)
    monkeypatch.setattr(load, "server_forwards", lambda url, headers: None)
    convs = [(f"first {i}", f"second {i}") for i in range(20)]
    res = run_load_bench("http://fake", levels=(2,), requests=3, prompts=convs, speculation="both")
    assert [(r["requests"], r["ok"]) for r in res["levels"]] == [(12, 12), (12, 12)]  # 2 clients x 3 x 2 turns
    assert all(r["ttft_p50_ms_by_turn"] == pytest.approx([4.0, 2.0]) for r in res["levels"])
    seconds = [m for m in sent if len(m["messages"]) == 3]
    assert len(seconds) == 12 and all(
        m["messages"][1] == {"role": "assistant", "content": f"answer to {m['messages'][0]['content']}"}
        and m["messages"][2]["content"] == m["messages"][0]["content"].replace("first", "second") for m in seconds)
    levels = [m for m in sent if "cache_salt" in m]  # the untimed warm-up sends none
    assert len(levels) == 24
    salts = {m["osd_speculate"]: m["cache_salt"] for m in levels}
    assert salts[True] != salts[False] and all(m["cache_salt"] == salts[m["osd_speculate"]] for m in levels)


def test_conversations_come_from_held_out_sharegpt():
    from infra.config import OSDConfig
    from pipeline.bench.load import load_conversations

    convs = load_conversations(OSDConfig(), limit=20)
    assert len(convs) == 20 and all(len(c) == 2 and all(t.strip() for t in c) for c in convs)
