"""The whole loop end to end on tiny models, under steady load with 0 failed requests:
serve -> records -> trainer -> registry -> canary -> a decision on the trained candidate;
then an injected better draft is promoted and an injected random-weights draft rolled back.
Stopping the loop is checked on its own too."""

import threading
import time

import pytest
import torch

from infra.config import load_config
from infra.registry import Registry



def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.redis
def test_closed_loop_promotes_a_trained_candidate_and_rolls_back_a_bad_one(tiny, tmp_path):
    from pipeline.demo import post_chat
    from infra.redis_server import free_port
    from pipeline.up import ClosedLoop
    from infra.draft_model import DraftSpec, build_draft, save_draft

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"port": free_port(), "max_new_tokens": 24, "num_cpus_per_replica": 0.5, "alias_poll_s": 0.3},
        "train": {"draft_layers": 1, "export_every_records": 12, "export_every_s": 1000, "held_out_every": 5,
                  "token_budget": 256, "max_seq_len": 128},
        "rollout": {"canary_steps": [0.5, 1.0], "min_requests": 4, "max_requests": 12, "poll_s": 0.3},
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
            return [d for d in loop.controller_status()["decisions"] if d["action"] in ("promote", "rollback")
                    and (version is None or d["version"] == version)]

        _wait(lambda: final(), 240, "a rollout decision on a trained candidate")
        trained = final()[0]
        assert trained["version"].startswith("t-v") and trained["evidence"], trained
        cand = reg.get(trained["version"])
        assert cand.lineage["records_consumed"] >= 12, cand.lineage
        # the controller takes the newest candidate, so an earlier export may have been skipped: the parent
        # is v1 or the trainer's previous export (each export continues from the one before)
        parent = cand.lineage["parent"]
        assert parent == "v1" or (parent.startswith("t-v") and parent < trained["version"]), cand.lineage
        loop.stop_trainer()  # from here on, only the injected versions compete (after any canary in flight)

        # an injected better draft is promoted ...
        reg.publish(tmp_path / "good", "good")
        _wait(lambda: final("good"), 180, "a decision on the better draft")
        assert final("good")[0]["action"] == "promote"
        stable = reg.alias("stable")
        assert stable["version"] == "good" and stable["previous"] in {v.id for v in reg.list()} - {"good"}

        # ... and an injected bad draft (random weights) is rolled back within a bounded number of requests
        bad = build_draft(tiny.model, spec)
        with torch.no_grad():
            for i, (name, p) in enumerate(bad.named_parameters()):
                if p.requires_grad:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(i))
        save_draft(bad, spec, tmp_path / "bad", target_ref={"spec": "tiny-random"})
        reg.publish(tmp_path / "bad", "bad")
        n_at_publish = len(results)
        _wait(lambda: final("bad"), 180, "the bad draft's rollback")
        assert final("bad")[0]["action"] == "rollback"
        assert len(results) - n_at_publish <= 80  # min_requests per arm at a 50% share, plus polling lag
        assert reg.alias("stable")["version"] == "good" and reg.alias("canary") is None
    finally:
        stop.set()
        for c in clients:
            c.join(70)
        loop.stop()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:3]
    versions = {r["version"] for r in results}
    assert {"v1", trained["version"], "good", "bad"} <= versions  # every swap happened under load
    audit = [(e["action"], e["version"]) for e in reg.audit_log()]
    assert ("promote", "good") in audit and ("rollback", "bad") in audit and ("start", "bad") in audit


@pytest.mark.pure
def test_stop_logs_a_part_ray_cannot_reach_and_still_stops_the_rest(capsys):
    import ray

    from pipeline.up import ClosedLoop

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
    from pipeline.up import ClosedLoop

    class BrokenGroup:
        def shutdown(self):
            raise KeyError("a bug, not an unreachable actor")

    loop = ClosedLoop(load_config(environ={}, overrides={}))
    loop._trainer_group = BrokenGroup()
    with pytest.raises(KeyError):
        loop.stop()
