"""Time to adapt (serve/api/ops/adapt.py): the last shift of the traffic's domain mix, the first
promotion after it, and its gain; and the ops summary and page that show them."""

import random
import time

import pytest

from serve.api.ops.adapt import SHIFT_WINDOW, last_shift, time_to_adapt, total_variation


def _points(domains, t0=1000.0):
    return [(t0 + i, d) for i, d in enumerate(domains)]


@pytest.mark.pure
def test_total_variation_is_half_the_l1_distance_of_the_mixes():
    from collections import Counter

    assert total_variation(Counter("aabb"), Counter("ab")) == 0.0
    assert total_variation(Counter("aa"), Counter("bb")) == 1.0
    assert total_variation(Counter("aaab"), Counter("abbb")) == pytest.approx(0.5)
    assert total_variation(Counter(), Counter("a")) == 0.0


@pytest.mark.pure
def test_a_clean_shift_is_found_at_its_first_record():
    shift = last_shift(_points(["other"] * 100 + ["code"] * 100))
    assert shift["time"] == 1100.0 and shift["distance"] == 1.0
    assert shift["before"] == {"other": 1.0} and shift["after"] == {"code": 1.0}


@pytest.mark.pure
def test_a_partial_shift_in_a_noisy_mix_is_found_near_where_it_happened():
    rng = random.Random(0)
    doms = [("code" if rng.random() < 0.2 else "other") for _ in range(150)]
    doms += [("code" if rng.random() < 0.9 else "other") for _ in range(150)]
    shift = last_shift(_points(doms))
    assert abs(shift["time"] - 1150.0) <= 10 and shift["after"]["code"] > 0.7 > 0.4 > shift["before"]["code"]


@pytest.mark.pure
def test_a_steady_mix_has_no_shift_and_too_few_records_say_nothing():
    rng = random.Random(1)
    assert last_shift(_points([rng.choice(["code", "other"]) for _ in range(400)])) is None
    assert last_shift(_points(["other"] * SHIFT_WINDOW + ["code"] * (SHIFT_WINDOW - 1))) is None


@pytest.mark.pure
def test_of_two_shifts_the_later_one_is_reported():
    shift = last_shift(_points(["other"] * 100 + ["code"] * 100 + ["math"] * 100))
    assert shift["time"] == 1200.0 and shift["before"] == {"code": 1.0}


@pytest.mark.pure
def test_time_to_adapt_is_the_first_promotion_after_the_shift_and_its_gain():
    shift = {"time": 1000.0}
    audit = [{"action": "promote", "version": "v1", "time": 500.0},
             {"action": "start", "version": "v2", "time": 1100.0},
             {"action": "rollback", "version": "v2", "time": 1150.0},
             {"action": "promote", "version": "v3", "time": 1240.0},
             {"action": "promote", "version": "v4", "time": 1900.0}]
    got = time_to_adapt(shift, audit, {"v1": 0.30, "v3": 0.42, "v2": 0.1}, now=2000.0)
    assert (got["promoted"], got["minutes"], got["replaced"]) == ("v3", 4.0, "v1")
    assert got["gain"] == pytest.approx(0.12) and got["waiting_min"] is None
    assert time_to_adapt(shift, audit, {"v3": 0.42}, now=2000.0)["gain"] is None  # v1 served nothing after it
    waiting = time_to_adapt(shift, audit[:3], {}, now=1600.0)
    assert waiting["promoted"] is None and waiting["waiting_min"] == 10.0 and waiting["replaced"] == "v1"
    assert time_to_adapt(None, audit, {}, now=2000.0) is None


@pytest.mark.redis
def test_the_ops_summary_and_page_show_the_time_to_adapt(tmp_path, redis_url, draft_dir):
    import numpy as np

    from infra.config import load_config
    from infra.records.schema import Record, encode
    from infra.registry import Registry
    from infra.records.streams import FIELD, connect
    from serve.api.ops.page import page
    from serve.api.ops.source import OpsSource

    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "stream": {"redis_url": redis_url, "stream": "t:records", "block_ms": 0}})
    reg = Registry.from_config(cfg)
    now = time.time()
    for v in ("v1", "v2"):
        reg.publish(draft_dir, v)
    reg.audit({"action": "promote", "version": "v1", "time": now - 1000})
    reg.audit({"action": "promote", "version": "v2", "time": now - 280})
    client = connect(redis_url, cfg.stream)

    def record(i, version, domain, accepted):
        return Record(request_id=f"r{i}", draft_version=version, prompt_ids=np.arange(3, dtype=np.int32),
                      output_ids=np.full(4, 5, np.int32), topk_ids=np.zeros((4, 2), np.int32),
                      topk_logprobs=np.zeros((4, 2), np.float16), accepted=np.array(accepted),
                      draft_tokens=np.array([7, 7, 7, 7], np.int32), draft_probs=np.full(4, 0.5, np.float32),
                      created_at=now - 800 + i, domain=domain)

    recs = [record(i, "v1", "other", [True, False, True, False]) for i in range(100)]  # before the shift
    recs += [record(100 + i, "v1", "code", [False, False, True, False]) for i in range(50)]  # v1 after: 1/4
    recs += [record(150 + i, "v2", "code", [True, True, True, False]) for i in range(50)]  # v2 after: 3/4
    for r in recs:
        client.xadd(cfg.stream.stream, {FIELD: encode(r)})
    s = OpsSource(cfg, client=client).summary([], now=now)
    a = s["adapt"]
    assert a["shift"]["time"] == pytest.approx(now - 700) and a["promoted"] == "v2" and a["replaced"] == "v1"
    assert a["minutes"] == pytest.approx((now - 280 - (now - 700)) / 60, abs=0.01)
    assert a["gain"] == pytest.approx(0.5)
    html = page(s)
    assert "id=ops-adapt" in html and "v2 promoted 7.0 min after it, acceptance +0.500 over v1" in html
