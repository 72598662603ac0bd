"""The whole loop end to end on tiny models, under steady load with 0 failed requests:
serve -> records -> trainer (gate at export) -> registry -> controller -> a decision on the
trained candidate; then an injected better draft, with gate evidence against the current
stable, is promoted, and an injected random-weights draft is gated: it never reaches a user.
Stopping the loop is checked on its own too.

The ops page is checked on the same loop (one loop start less in the suite): once the first
decision is taken, its summary shows the trainer's status (from its telemetry), both consumer
groups with their lag, the candidate and the controller's decision, and the page is
screenshotted in that state."""

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from infra.config import load_config
from infra.registry import Registry

SCREENSHOT = Path(__file__).resolve().parent.parent / "reports" / "ops" / "ops-loop.png"


def _gate_evidence(cfg, reg, tiny, draft):
    """What the trainer stores at export (train/gate/compare.py), computed here for a draft published by
    hand: `draft` against the current stable version on held-out records of the tiny target."""
    from infra.prompts import Prompt
    from train.gate.evaluator import gate_candidate
    from train.teacher.data import generate_teacher_records

    prompts = [Prompt(f"h{i}", f"held out {i}?" * (1 + i % 3), "other", "train") for i in range(10)]
    records = generate_teacher_records(tiny.model, tiny.tokenizer, prompts, max_new_tokens=6, top_k=32,
                                       progress=False)
    stable = reg.alias("stable")["version"]
    model, _ = reg.load_draft(stable, tiny.model)
    return gate_candidate(draft, model, stable, records, cfg.train.max_seq_len, min_records=len(records),
                          resamples=300)


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return got


def _check_the_page(loop, cfg):
    """The ops page follows the loop: the trainer, the stream's groups, the candidate and the
    controller's decision (tests the summary, then the page in a real browser)."""
    from serve.api.ops.page import fetch_summary

    def decided():
        s = fetch_summary(loop.url)
        return s if s and s["header"]["last_decision"] and s["loop"]["trainers"] else None

    s = _wait(decided, 60, "a trainer export and a rollout decision on the page")
    (t,) = s["loop"]["trainers"]
    # The first export follows 12 trained records, but the page's count is the trainer's last
    # step report, which can trail an export by that step's records (seen: 10).
    assert t["step"] >= 1 and t["loss"] is not None and t["records"] >= 9 and t["exports"] >= 1
    assert t["last_checkpoint"] and t["last_export"]["version"].startswith("t-v")
    groups = {g["group"]: g for g in s["loop"]["stream"]["groups"]}
    assert {cfg.stream.group, cfg.rollout.group} <= set(groups)
    assert all(g["lag"] is not None and g["lag"] >= 0 for g in groups.values())
    assert s["loop"]["last_candidate"]["version"].startswith("t-v")
    assert s["versions"][0]["version"] == s["header"]["stable"]  # v1, or a candidate already promoted
    assert any(r["requests"] > 0 and r["acceptance"] is not None for r in s["versions"])
    assert s["header"]["last_decision"]["version"].startswith("t-v")
    _screenshot(loop.url)


def _screenshot(url):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/ops")  # no key on this stack: the page opens directly
            page.wait_for_selector("#ops-trainers")
            assert page.locator("#ops-trainers tr").count() >= 2  # header + the trainer
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.deepspeed
def test_closed_loop_promotes_a_trained_candidate_and_rolls_back_a_bad_one(tiny, tmp_path):
    from pipeline.traffic.speed_checks import post_chat
    from infra.redis.server import free_port
    from pipeline.stack.up import ClosedLoop
    from infra.drafts.layer import DraftSpec, build_draft, save_draft

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"port": free_port(), "max_new_tokens": 24, "num_cpus_per_replica": 0.5, "alias_poll_s": 0.3},
        "train": {"draft_layers": 1, "export_every_records": 12, "export_every_s": 1000, "held_out_every": 5,
                  "token_budget": 256, "max_seq_len": 128, "gate": {"min_records": 2, "resamples": 300}},
        "rollout": {"canary_steps": [0.5, 1.0], "min_requests": 4, "max_requests": 40, "poll_s": 0.3},
    })
    spec = DraftSpec(num_layers=1)  # the warm start: 1 of the target's 2 layers
    save_draft(build_draft(tiny.model, spec), spec, tmp_path / "drafts" / "v1", target_ref={"spec": "tiny-random"})
    full = DraftSpec(num_layers=2)  # both layers: the target itself, acceptance 1 under greedy
    save_draft(build_draft(tiny.model, full), full, tmp_path / "good", target_ref={"spec": "tiny-random"})
    reg = Registry.from_config(cfg)

    results, stop = [], threading.Event()

    def client(url, seed):
        i = 0
        while not stop.is_set():
            i += 1
            results.append(post_chat(url, f"tell me about item {seed}-{i} " * 3, 24, timeout=60))

    loop = ClosedLoop(cfg, run_name="t").start()
    clients = [threading.Thread(target=client, args=(loop.url, s), daemon=True) for s in range(2)]
    try:
        for c in clients:
            c.start()
        # the trainer publishes candidates from live records; the controller decides on one
        def final(version=None):
            return [d for d in loop.controller_status()["decisions"]
                    if d["action"] in ("promote", "rollback", "gated", "expired")
                    and (version is None or d["version"] == version)]

        _wait(lambda: final(), 240, "a rollout decision on a trained candidate")
        trained = final()[0]
        _check_the_page(loop, cfg)
        assert trained["version"].startswith("t-v") and trained["evidence"], trained
        cand = reg.get(trained["version"])
        assert cand.lineage["records_consumed"] >= 12, cand.lineage
        # the trainer scored it against the stable version at export, whatever the outcome
        assert cand.metrics["gate"]["stable"] == "v1" and "passed" in cand.metrics["gate"], cand.metrics
        # the controller takes the newest candidate, so an earlier export may have been skipped: the parent
        # is v1 or the trainer's previous export (each export continues from the one before)
        parent = cand.lineage["parent"]
        assert parent == "v1" or (parent.startswith("t-v") and parent < trained["version"]), cand.lineage
        loop.stop_trainer()  # from here on, only the injected versions compete (after any canary in flight)

        def settled():  # no canary and every version newer than stable decided: stable will not move
            decided = {e["version"] for e in reg.audit_log() if e["action"] in ("promote", "rollback", "gated",
                                                                               "expired")}
            st = reg.get(reg.alias("stable")["version"])
            return reg.alias("canary") is None and all(
                v.id in decided for v in reg.list() if v.created_at > st.created_at)

        _wait(settled, 180, "the trained candidates' decisions")  # gate evidence is against *this* stable

        # an injected better draft, with passing gate evidence against the current stable, is promoted ...
        evidence = _gate_evidence(cfg, reg, tiny, build_draft(tiny.model, full))
        assert evidence["passed"], evidence
        reg.publish(tmp_path / "good", "good", metrics={"gate": evidence})
        _wait(lambda: final("good"), 180, "a decision on the better draft")
        assert final("good")[0]["action"] == "promote"
        stable = reg.alias("stable")
        assert stable["version"] == "good" and stable["previous"] in {v.id for v in reg.list()} - {"good"}

        # ... and an injected bad draft (random weights) is gated: it never becomes the canary
        bad = build_draft(tiny.model, spec)
        with torch.no_grad():
            for i, (name, p) in enumerate(bad.named_parameters()):
                if p.requires_grad:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
        save_draft(bad, spec, tmp_path / "bad", target_ref={"spec": "tiny-random"})
        evidence = _gate_evidence(cfg, reg, tiny, bad)
        reg.publish(tmp_path / "bad", "bad", metrics={"gate": evidence})
        _wait(lambda: final("bad"), 60, "the bad draft's gate decision")
        assert final("bad")[0]["action"] == "gated" and final("bad")[0]["evidence"]["gate"]["upper"] < 0
        assert reg.alias("stable")["version"] == "good" and reg.alias("canary") is None
        time.sleep(2)  # requests after the decision: still none on "bad"
    finally:
        stop.set()
        for c in clients:
            c.join(70)
        loop.stop()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:3]
    versions = {r["version"] for r in results}
    assert {"v1", "good"} <= versions and "bad" not in versions  # swaps under load; the gated one never served
    audit = [(e["action"], e["version"]) for e in reg.audit_log()]
    assert ("promote", "good") in audit and ("gated", "bad") in audit and ("start", "bad") not in audit


@pytest.mark.pure
def test_stop_logs_a_part_ray_cannot_reach_and_still_stops_the_rest(capsys):
    import ray

    from pipeline.stack.up import ClosedLoop

    class DeadGroup:
        def shutdown(self):
            raise ray.exceptions.ActorDiedError()

    class Stack:
        stopped = False

        def stop(self):
            self.stopped = True

    loop = ClosedLoop(load_config(environ={}, overrides={}))
    loop._trainer_group, loop.stack = DeadGroup(), Stack()
    loop.stop()
    assert loop.stack.stopped
    assert "stopping the trainer group failed (ActorDiedError" in capsys.readouterr().out


@pytest.mark.pure
def test_stop_does_not_hide_an_error_that_is_not_ray_s():
    from pipeline.stack.up import ClosedLoop

    class BrokenGroup:
        def shutdown(self):
            raise KeyError("a bug, not an unreachable actor")

    loop = ClosedLoop(load_config(environ={}, overrides={}))
    loop._trainer_group = BrokenGroup()
    with pytest.raises(KeyError):
        loop.stop()
