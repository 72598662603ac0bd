"""How a native runner runs small forwards (serve/model/native_tuning.py): measured once per
runner kind; one thread kept only where it is nearly as fast as all of them, prefetching only
where it is no slower. The step is a fake that advances a fake clock, so the rule is tested,
not this machine."""

import pytest

from serve.model import native_build, native_tuning
from serve.model.native_tuning import MEASURE_MIN_BYTES, SMALL_FORWARD_ROWS, Tuning, tune

pytestmark = [pytest.mark.pure]

BIG = MEASURE_MIN_BYTES


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.slept = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.slept += s


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(native_tuning, "time", c)
    monkeypatch.setattr(native_tuning, "_decided", {})
    return c


def stepper(clock, ms):
    """ms[(threads, prefetch)]: what each way of stepping costs."""
    calls = []

    def step(n, pf):
        calls.append((n, pf))
        clock.now += ms[(n, pf)] / 1e3

    return step, calls


def test_one_thread_is_kept_where_one_core_streams_nearly_as_fast(clock):
    step, calls = stepper(clock, {(1, True): 3.5, (1, False): 3.4, (2, True): 3.1, (2, False): 3.2})
    t = tune(("a",), BIG, 2, step)
    assert t.small_rows == SMALL_FORWARD_ROWS and t.prefetch
    assert all(calls.count(way) == 1 + native_tuning.REPEATS for way in set(calls)) and len(set(calls)) == 4
    assert clock.slept >= native_tuning.SETTLE_S
    want = {"2 threads": 3.1, "2 threads, no prefetch": 3.2, "1 thread": 3.5, "1 thread, no prefetch": 3.4}
    assert t.ms == pytest.approx(want)


def test_every_thread_serves_small_forwards_where_one_core_streams_far_less(clock):
    step, _ = stepper(clock, {(1, True): 11.6, (1, False): 14.1, (2, True): 5.8, (2, False): 7.6})
    t = tune(("b",), BIG, 2, step)
    assert (t.small_rows, t.prefetch) == (0, True)


def test_prefetch_is_dropped_where_it_is_slower_and_one_thread_judged_without_it(clock):
    # Prefetching slows the 2-thread step; without it one thread is within the slack.
    step, _ = stepper(clock, {(1, True): 9.0, (1, False): 3.4, (2, True): 3.5, (2, False): 3.1})
    t = tune(("c",), BIG, 2, step)
    assert not t.prefetch and t.small_rows == SMALL_FORWARD_ROWS


def test_the_rule_is_measured_once_per_key(clock):
    step, calls = stepper(clock, {(1, True): 11.6, (1, False): 11.0, (4, True): 5.8, (4, False): 6.0})
    first = tune(("d",), BIG, 4, step)
    n = len(calls)
    assert tune(("d",), BIG, 4, step) == first and len(calls) == n
    assert native_tuning._decided == {("d",): first}


def test_one_thread_measures_only_the_prefetch(clock):
    step, calls = stepper(clock, {(1, True): 6.0, (1, False): 5.0})
    t = tune(("e",), BIG, 1, step)
    assert set(calls) == {(1, True), (1, False)} and not t.prefetch and t.small_rows == SMALL_FORWARD_ROWS


def wide_stepper(clock, ms):
    """ms[amx rows]: what a probe forward costs with AMX from that many rows (0: off)."""
    calls = []

    def wide(n, prefetch):
        assert prefetch  # the probe runs with the prefetch setting just chosen
        calls.append(n)
        clock.now += ms[n] / 1e3

    return wide, calls


@pytest.mark.parametrize("amx_ms, kept", [(11.4, native_tuning.AMX_MIN_ROWS), (13.5, 0)])
def test_amx_tiles_are_kept_only_where_the_probe_forward_is_faster(clock, amx_ms, kept):
    step, _ = stepper(clock, {(1, True): 11.6, (1, False): 14.1, (2, True): 5.8, (2, False): 7.6})
    wide, calls = wide_stepper(clock, {native_tuning.AMX_MIN_ROWS: amx_ms, 0: 12.8})
    t = tune(("amx", amx_ms), BIG, 2, step, wide)
    assert t.amx_rows == kept
    assert sorted(set(calls)) == [0, native_tuning.AMX_MIN_ROWS]
    assert all(calls.count(n) == 1 + native_tuning.REPEATS for n in set(calls))
    rows = native_tuning.AMX_PROBE_ROWS
    assert t.ms[f"{rows} rows, AMX"] == pytest.approx(amx_ms) and t.ms[f"{rows} rows, no AMX"] == pytest.approx(12.8)


def test_without_a_probe_amx_stays_off(clock):
    step, _ = stepper(clock, {(1, True): 11.6, (1, False): 14.1, (2, True): 5.8, (2, False): 7.6})
    t = tune(("no-amx",), BIG, 2, step)
    assert t.amx_rows == 0 and not any("AMX" in k for k in t.ms)


def test_osd_native_amx_off_rules_the_tiles_out(monkeypatch):
    monkeypatch.setenv("OSD_NATIVE_AMX", "off")
    assert not native_tuning.amx_allowed()
    monkeypatch.setenv("OSD_NATIVE_AMX", "auto")
    assert native_tuning.amx_allowed()
    monkeypatch.setenv("OSD_NATIVE_AMX", "no")
    with pytest.raises(ValueError, match="OSD_NATIVE_AMX must be auto or off, got 'no'"):
        native_tuning.amx_allowed()


class FakeLib:
    """Records each setting a measurement makes."""

    def __init__(self):
        self.prefetch, self.amx = [], []

    def osd_set_prefetch(self, on):
        self.prefetch.append(on)

    def osd_set_amx(self, n):
        self.amx.append(n)


class FakeRunner:
    """Records each forward a measurement runs: (its tokens' shape, the cache's start, threads)."""

    def __init__(self):
        self.lib = FakeLib()
        self.seen = []

    def new_cache(self):
        return type("Cache", (), {"length": 7})()

    def forward_rows_on(self, items, threads):
        (it,) = items
        self.seen.append((tuple(it.tokens.shape), it.cache.length, threads))


def test_the_probe_of_a_real_runner_is_a_wide_forward_with_amx_from_n_rows():
    r = FakeRunner()
    wide = native_tuning.measure_wide(r, 2)
    wide(9, True)
    wide(0, False)
    rows = native_tuning.AMX_PROBE_ROWS
    assert r.seen == [((rows,), 0, 2), ((rows,), 0, 2)] and r.lib.amx == [9, 0] and r.lib.prefetch == [1, 0]


def test_tiny_weights_are_not_measured(clock):
    step, calls = stepper(clock, {})
    assert tune(("f",), BIG - 1, 2, step) == Tuning()
    assert calls == []


def test_the_step_of_a_real_runner_is_a_one_row_forward_on_n_threads():
    r = FakeRunner()
    step = native_tuning.measure_step(r)
    step(2, True)
    step(1, False)
    assert r.seen == [((1,), 0, 2), ((1,), 0, 1)] and r.lib.prefetch == [1, 0]


@pytest.mark.skipif(not native_build.supported(), reason="this CPU runs no native variant")
def test_a_runner_measures_at_load_and_prefetching_never_changes_a_bit(monkeypatch):
    import torch

    from infra.target import build_tiny_llama
    from serve.model.native_runner import NativeLlamaRunner

    monkeypatch.setattr(native_tuning, "MEASURE_MIN_BYTES", 0)
    monkeypatch.setattr(native_tuning, "_decided", {})
    model = build_tiny_llama(seed=0, num_layers=2, max_positions=64, dtype="bfloat16", vocab_size=304,
                             hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
    r = NativeLlamaRunner(model, 64)
    probed = 2 if r.lib.osd_set_amx(0) and native_tuning.amx_allowed() else 0
    r.lib.osd_set_amx(r.tuning.amx_rows)
    assert len(r.tuning.ms) == (4 if r.threads > 1 else 2) + probed and r.small_rows == r.tuning.small_rows
    tokens = torch.arange(1, 12)
    out = {}
    for pf in (0, 1):
        r.lib.osd_set_prefetch(pf)
        cache = r.new_cache()
        out[pf] = (r.forward(tokens[:9], cache), r.forward(tokens[9:], cache))
    r.lib.osd_set_prefetch(int(r.tuning.prefetch))
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))


def test_an_older_library_without_the_prefetch_switch_still_loads(tmp_path):
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("no compiler")
    src = tmp_path / "old.cpp"
    src.write_text('extern "C" { int osd_isa(void) { return 0; } int osd_forward(void*, void*) { return 0; }\n'
                   'void osd_gemm(void*, int, int, int, void*, int, void*, int) {} }\n')
    so = tmp_path / "libold.so"
    subprocess.run(["g++", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    lib = native_build.load_file(so)
    assert lib.osd_set_prefetch(1) is None and lib.osd_isa() == 0
