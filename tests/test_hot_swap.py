"""Hot swap in a target replica (constructed directly, no Serve): registry versions by id,
requests in flight keep their draft, a version with a bad digest or made for another target
is refused."""

import asyncio
import time

import pytest

from loop_helpers import registry_for_replica
from serve.api.hot_swap import DraftRouter, Routing

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def setup(tiny, tmp_path):
    return registry_for_replica(tiny, tmp_path, (1, 2, 1), alias_poll_s=0.1, max_new_tokens=64)


def _req(i, max_tokens=48):
    return {"kind": "completion", "prompt": [5, 6, 7, i % 50 + 3], "max_tokens": max_tokens, "request_id": f"r{i}",
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}, "stop": [], "record": False}


def test_in_flight_requests_finish_on_their_draft_and_new_ones_swap(setup):
    from serve.api.app import TargetReplica

    cfg, reg = setup
    rep = TargetReplica(cfg.model_dump(mode="json"))
    try:
        assert rep.router.state()["stable"] == "v1"
        ar = asyncio.run(rep.generate({**_req(0), "speculate": False}))

        async def scenario():
            first = asyncio.create_task(rep.generate(_req(0)))
            await asyncio.sleep(0.05)  # in flight
            reg.promote("v2")  # the replica's alias poller picks this up
            deadline = time.monotonic() + 20
            while rep.router.state()["stable"] != "v2":
                assert time.monotonic() < deadline, "alias move never reached the replica"
                await asyncio.sleep(0.05)
            second = await rep.generate(_req(0))
            return await first, second

        first, second = asyncio.run(scenario())
        assert first["draft_version"] == "v1" and second["draft_version"] == "v2"
        assert first["output_ids"] == second["output_ids"] == ar["output_ids"]  # greedy: lossless either way
        assert second["num_draft_tokens"] > 0

        # canary by request id: both arms serve, each id always to the same arm
        reg.set_canary("v3", 0.5)
        deadline = time.monotonic() + 20
        while rep.router.state()["canary"] != "v3":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        arms = {i: rep.router.pick(f"id-{i}")[0] for i in range(200)}
        assert set(arms.values()) == {"v2", "v3"} and 60 < sum(v == "v3" for v in arms.values()) < 140
        assert all(rep.router.pick(f"id-{i}")[0] == arms[i] for i in range(200))
    finally:
        rep.router.stop_following()


def test_bad_digest_is_refused_and_the_replica_keeps_serving(setup):
    from serve.api.app import TargetReplica

    cfg, reg = setup
    rep = TargetReplica(cfg.model_dump(mode="json"))
    rep.router.stop_following()
    weights = reg.local_path("v2") / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    rep.reconfigure({"stable": "v2"})
    st = rep.router.state()
    assert st["stable"] == "v1" and "v2" in st["refused"] and "sha256" in st["refused"]["v2"]
    out = asyncio.run(rep.generate(_req(1, 8)))
    assert out["draft_version"] == "v1" and out["output_ids"] and out["finish_reason"] in ("stop", "length")
    rep.reconfigure({"stable": "v3", "canary": "v1", "canary_weight": 0.25})  # a good version still works
    st = rep.router.state()
    assert (st["stable"], st["canary"], st["canary_weight"]) == ("v3", "v1", 0.25)
    assert rep.stats()["drafts"]["refused"].keys() == {"v2"}


def test_a_version_for_another_target_is_refused_and_the_replica_keeps_serving(setup, tmp_path):
    """Same shapes, other weights: only the recorded target identity tells them apart."""
    from infra.drafts.layer import DraftSpec, build_draft, save_draft, target_ref
    from infra.target import load_target, target_identity
    from serve.api.app import TargetReplica

    cfg, reg = setup
    other = load_target("tiny-random:2", progress=False)
    spec = DraftSpec(num_layers=1)
    save_draft(build_draft(other.model, spec), spec, tmp_path / "foreign", target_ref=target_ref(other))
    reg.publish(tmp_path / "foreign", "v4")
    rep = TargetReplica(cfg.model_dump(mode="json"))
    rep.router.stop_following()
    rep.reconfigure({"stable": "v4"})
    st = rep.router.state()
    mine, theirs = target_identity(load_target("tiny-random", progress=False)), target_identity(other)
    assert st["stable"] == "v1" and "made for target 'tiny-random:2'" in st["refused"]["v4"]
    assert theirs[:12] in st["refused"]["v4"] and mine[:12] in st["refused"]["v4"]
    out = asyncio.run(rep.generate(_req(2, 8)))
    assert out["draft_version"] == "v1" and out["output_ids"]


def test_router_apply_is_all_or_nothing():
    loaded = []

    def load(v):
        if v == "broken":
            raise ValueError("digest mismatch")
        loaded.append(v)
        return f"runner-{v}"

    r = DraftRouter(load, Routing("a", "runner-a"), log=lambda m: None)
    assert not r.apply("b", "broken", 0.5)  # canary cannot load: nothing changes, not even stable
    assert r.routing.stable == "a" and r.routing.canary is None and loaded == ["b"]
    assert not r.apply("b", "broken", 0.5) and loaded == ["b"]  # refused once, not retried
    assert r.apply("b", "c", 0.5) and r.pick("x")[1] in ("runner-b", "runner-c")
    assert r.apply("b", None, 0.0) and r.routing.canary is None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_alias_poller_survives_a_malformed_alias_file_and_health_sees_a_dead_one():
    """Issue 18, defect 9: a canary alias without `weight` used to kill the poller silently
    while state() still said it was following."""
    logs: list[str] = []
    router = DraftRouter(lambda v: f"runner-{v}", Routing("v1", "runner-v1"), logs.append)
    reads = iter([{"stable": {"version": "v1"}, "canary": {"version": "v2"}},  # no weight
                  {"stable": {"version": "v2"}, "canary": None}])

    def read():
        return next(reads, {"stable": {"version": "v2"}, "canary": None})

    router.follow_aliases(read, 0.01)
    try:
        deadline = time.monotonic() + 10
        while router.routing.stable != "v2":
            assert time.monotonic() < deadline, "the poller stopped following after a malformed alias"
            time.sleep(0.01)
        assert any("malformed alias" in m for m in logs)
        assert router.state()["following_aliases"] is True
        router.check_health()
    finally:
        router.stop_following()

    dead = DraftRouter(lambda v: v, Routing("v1", None), logs.append)
    dead.follow_aliases(lambda: (_ for _ in ()).throw(SystemExit()), 0.01)  # dies past `except Exception`
    dead._thread.join(5)
    assert dead.state()["following_aliases"] is False
    with pytest.raises(RuntimeError, match="poller"):
        dead.check_health()


@pytest.fixture
def head_registry(tiny, tmp_path):
    """A registry of two heads of the tiny target (v1 stable), and a replica config that serves
    each beside one suffix index (registry+suffix, the loop's draft)."""
    import torch

    from infra.config import load_config
    from infra.drafts.head import build_head, save_head
    from infra.drafts.layer import target_ref
    from infra.drafts.spec import DraftSpec
    from infra.registry import Registry

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "model": {"target": "tiny-random"},
        "serve": {"draft": "registry+suffix", "record": False, "alias_poll_s": 0.1, "max_new_tokens": 64}})
    reg = Registry.from_config(cfg)
    for i in (1, 2):
        torch.manual_seed(i)
        head = build_head(tiny.model, DraftSpec(family="head"))
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # two heads that differ
        save_head(head, tmp_path / f"h{i}", target_ref=target_ref(tiny))
        reg.publish(tmp_path / f"h{i}", f"v{i}")
    return cfg, reg


def test_registry_with_suffix_serves_each_head_beside_the_one_index_it_keeps(head_registry):
    from serve.api.app import TargetReplica
    from serve.spec_decode.suffix.draft import HybridDraft, suffix_of

    cfg, reg = head_registry
    rep = TargetReplica(cfg.model_dump(mode="json"))
    try:
        index = rep._suffix
        assert rep.router.state()["stable"] == "suffix" and rep.router.routing.stable_runner is not None
        ar = asyncio.run(rep.generate({**_req(0), "speculate": False}))
        alone = asyncio.run(rep.generate(_req(0)))  # no stable head yet: the suffix draft alone
        assert alone["draft_version"] == "suffix" and alone["output_ids"] == ar["output_ids"]

        from loop_helpers import greedy_records
        from serve.spec_decode.suffix.draft import warm_from_records

        assert warm_from_records(index, greedy_records(2, 8, 16)) > 0
        learned = index.stats()["global_tokens"]
        for version in ("v1", "v2"):
            reg.promote(version)
            deadline = time.monotonic() + 20
            while rep.router.state()["stable"] != version:
                assert time.monotonic() < deadline, "alias move never reached the replica"
                time.sleep(0.05)
            runner = rep.router.routing.stable_runner
            assert isinstance(runner, HybridDraft) and suffix_of(runner) is index
            out = asyncio.run(rep.generate(_req(0)))
            assert out["draft_version"] == version and out["output_ids"] == ar["output_ids"]  # greedy: lossless
            assert index.stats()["global_tokens"] == learned  # what the index learned outlives the swap
    finally:
        rep.router.stop_following()
