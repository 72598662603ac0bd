"""`make demo` / `osd demo`: the closed loop on real traffic whose domain shifts part-way.

1. Prepare the target (cached) and the warm-start draft v1, a head by default (`osd draft init
   --family head`; `--family layer`: `osd draft init`), cached.
2. `osd up` in-process on a fresh demo state dir: serving follows the registry aliases, the
   trainer distills on the live records, the controller canaries each candidate.
3. Workload: held-out ShareGPT prompts of general domains, then code only (the shift).
4. Same-server speed checks (pipeline/traffic/speed_checks.py) on post-shift prompts: each
   prompt with speculation and without (`osd_speculate: false`), alternating which goes first,
   each mode with its own cache_salt (neither starts from the other's prefill); median of
   per-prompt ratios.
   Then the frozen check: v1 made stable again for the same prompts (the suffix index as the
   loop left it), so the final draft minus v1, per prompt, is what the loop's training brought.
5. reports/demo/report.json, a PNG of per-request acceptance over time per version, and ops.html:
   the ops page (/ops) as it stood at the end of the run, static.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from infra.config import OSDConfig
from pipeline.traffic.speed_checks import (batched_contribution, drafting, final_and_frozen, log,
                                           loop_contribution, post_chat, throughput_speedup)


# Held-out post-shift records the paired estimate scores every version on, at most: enough to
# separate versions a point apart (paired), few enough that the report does not wait long.
PAIRED_RECORDS = 200


class Workload:
    """Closed loop of `concurrency` clients over a prompt list, until a deadline."""

    def __init__(self, url: str, max_tokens: int, concurrency: int):
        self.url, self.max_tokens, self.concurrency = url, max_tokens, concurrency
        self.results: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def run(self, phase: str, prompts: list, seconds: float, status: Any = None) -> None:
        deadline = time.monotonic() + seconds
        it = iter(prompts * 100)
        last_print = [time.monotonic()]

        def client() -> None:
            while time.monotonic() < deadline:
                with self._lock:
                    p = next(it)
                r = post_chat(self.url, p.text, self.max_tokens)
                r.update(phase=phase, domain=p.domain, time=time.time())
                with self._lock:
                    self.results.append(r)
                    n = sum(1 for x in self.results if x["phase"] == phase)
                    if time.monotonic() - last_print[0] >= 30:
                        last_print[0] = time.monotonic()
                        left = max(0, deadline - time.monotonic())
                        log(f"{phase}: {n} requests, {left:.0f} s left" + (f"; {status()}" if status else ""))

        with ThreadPoolExecutor(self.concurrency) as pool:
            for f in [pool.submit(client) for _ in range(self.concurrency)]:
                f.result()


def minutes_to_first_promotion(decisions: list[dict[str, Any]], shift: float) -> tuple[float | None, str | None]:
    """(minutes from the shift to the first promotion after it, the version promoted); (None,
    None) if none. A promotion before the shift adapted to general traffic, not to the shift."""
    after = sorted((d for d in decisions if d["action"] == "promote" and d["time"] >= shift), key=lambda d: d["time"])
    if not after:
        return None, None
    return (after[0]["time"] - shift) / 60, after[0]["version"]


def version_table(samples: list[dict], shift_time: float, registry: Any) -> list[dict[str, Any]]:
    """Per version: served requests and mean per-request acceptance, before and after the shift."""
    out = []
    known = {v.id: v for v in registry.list()}
    for vid in sorted({s["version"] for s in samples}, key=lambda v: known[v].created_at if v in known else 0):
        mine = [s for s in samples if s["version"] == vid]
        post = [s["acceptance"] for s in mine if s["time"] >= shift_time]
        pre = [s["acceptance"] for s in mine if s["time"] < shift_time]
        v = known.get(vid)
        out.append({"version": vid, "alpha": statistics.fmean(s["acceptance"] for s in mine),
                    "alpha_post_shift": statistics.fmean(post) if post else None,
                    "alpha_pre_shift": statistics.fmean(pre) if pre else None,
                    "requests": len(mine), "requests_post_shift": len(post),
                    "mean_accepted_len": statistics.fmean(s["mean_accepted_len"] for s in mine),
                    "alpha_est": v.metrics.get("alpha_est") if v else None,
                    "parent": v.lineage.get("parent") if v else None,
                    "records_consumed": v.lineage.get("records_consumed") if v else None})
    return out


def stream_records(cfg: OSDConfig) -> list:
    """The run's records (its Redis is private to the run), read before the private Redis goes away. A Redis that cannot answer
    costs the paired estimate only, never the report."""
    import redis

    from infra.records.streams import connect, read_records

    try:
        client = connect(cfg.stream.redis_url, cfg.stream)
        try:
            return read_records(client, cfg.stream.stream)
        finally:
            client.close()
    except redis.RedisError as e:
        log(f"paired estimate skipped: cannot read the record stream ({type(e).__name__}: {e})")
        return []


def paired_alpha(cfg: OSDConfig, records: list, shift_time: float, target: Any, registry: Any,
                 max_records: int = PAIRED_RECORDS) -> dict[str, Any]:
    """Every registry version, served or not, on the *same* post-shift code records: the ones the
    trainer held out, whose prompt it never trained on either, so no version saw them. Served α per version comes from different
    requests, and acceptance varies far more between prompts than between drafts; on identical
    positions the versions are compared paired, and the trainer's lineage shows whether it learns."""
    from train.online.family import family_name, per_record, per_record_head
    from train.online.trainer import is_held_out

    every = cfg.train.held_out_every
    # A held-out record whose prompt was also served in a record the trainer took is not unseen.
    trained_prompts = {r.prompt_ids.tobytes() for r in records if not is_held_out(r.record_id, every)}
    held = [r for r in records if r.created_at >= shift_time and r.domain == "code"
            and is_held_out(r.record_id, every) and r.prompt_ids.tobytes() not in trained_prompts]
    if len(held) > max_records:  # evenly over the phase: the estimate's cost is the target's forward over them
        step = len(held) / max_records
        held = [held[int(i * step)] for i in range(max_records)]
    out: dict[str, Any] = {"records": len(held), "positions": sum(r.n_positions for r in held), "versions": []}
    if not held:
        return out
    versions = registry.list()
    features: dict = {}  # the target's features, computed once and shared by every head
    started = time.monotonic()
    for i, v in enumerate(versions, 1):
        log(f"paired estimate: {v.id} ({i} of {len(versions)}, {len(held)} records, "
             f"{time.monotonic() - started:.0f} s so far)")
        try:
            draft, _ = registry.load_draft(v.id, target)
        except Exception as e:  # a version gc'd or unreadable: say so, keep the others
            log(f"paired estimate: cannot load {v.id} ({type(e).__name__}: {e})")
            continue
        # Each version by its own family (a head reads the target's features), on the same
        # positions and measure, as the gate scores them: a ratio of sums over positions.
        # The bound is speculative sampling's acceptance; the demo's requests are greedy, whose
        # verify accepts where the head's greedy token is the target's: a head's loss may move
        # the two apart, so a head's entry gives both (one unroll).
        if family_name(draft) == "head":
            both = per_record_head(draft, target, held, cfg.train.max_seq_len, features)
            scores, greedy = [(b, n) for b, _, n in both], sum(g for _, g, _ in both)
        else:
            scores, greedy = per_record(draft, target, held, cfg.train.max_seq_len, features), None
        n = sum(p for _, p in scores)
        out["versions"].append({"version": v.id, "parent": v.lineage.get("parent"),
                                "records_consumed": v.lineage.get("records_consumed"),
                                "family": family_name(draft),
                                "alpha_est": sum(a for a, _ in scores) / n if n else None,
                                "greedy_est": greedy / n if greedy is not None and n else None})
        del draft
    return out


def write_prompts(prompts: list, path: Path) -> None:
    """JSONL that `osd bench engine --prompts-file` reads back (id, domain and text kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": p.id, "domain": p.domain, "prompt": p.text}) + "\n" for p in prompts))


def plot(samples: list[dict], shift_time: float, t0: float, decisions: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for vid in sorted({s["version"] for s in samples}):
        pts = sorted((s["time"] - t0, s["acceptance"]) for s in samples if s["version"] == vid)
        xs, ys = [p[0] / 60 for p in pts], [p[1] for p in pts]
        ax.scatter(xs, ys, s=8, alpha=0.35)
        w = 8  # rolling mean over 8 requests
        roll = [statistics.fmean(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, roll, label=f"{vid} ({len(ys)} req)")
    ax.axvline((shift_time - t0) / 60, color="k", ls="--", lw=1)
    ax.text((shift_time - t0) / 60, 1.01, " shift: general -> code", fontsize=8, va="bottom")
    for d in decisions:
        if d["action"] in ("promote", "rollback"):
            ax.axvline((d["time"] - t0) / 60, color="g" if d["action"] == "promote" else "r", lw=0.8, alpha=0.6)
    ax.set_xlabel("minutes")
    ax.set_ylabel("acceptance per request (rolling mean of 8)")
    ax.set_ylim(0, 1.05)
    ax.set_title("osd demo: acceptance over time per draft version (green: promote, red: rollback)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_ops_snapshot(summary: dict[str, Any] | None, url: str, out_dir: Path) -> dict[str, Any]:
    """The ops page as it stood at the end of the run, as static HTML next to report.json."""
    from serve.api.ops import page as ops_page

    out: dict[str, Any] = {"page": f"{url}/ops", "snapshot": None}
    if summary is not None:
        (out_dir / "ops.html").write_text(ops_page.page(summary, live=False))
        out["snapshot"] = "ops.html"
    return out


# Online means minutes (issue 42): the demo shows what the loop brings within 20 minutes of
# set-up. Eight clients keep the replica busy at every step, so the trainer's records, the gate's
# held-out records and a canary's request budget gather sooner than with two; ten minutes of code
# traffic then leave room to train, gate, canary and promote a candidate, and two minutes of
# general traffic show how v1 serves before the shift.
def run_demo(cfg: OSDConfig, *, general_s: float = 120, code_s: float = 600, speed_prompts: int = 48,
             max_tokens: int = 64, concurrency: int = 8, out_dir: str | Path = "reports/demo",
             family: str = "head") -> dict[str, Any]:
    from infra.registry import Registry
    from pipeline.stack.profiles import demo_config
    from pipeline.stack.up import ClosedLoop, ensure_stable
    from serve.api.ops.page import fetch_summary

    t_start = time.time()
    loaded, v1 = prepare(cfg, family)
    setup_s = time.time() - t_start
    state = Path(cfg.state_dir) / "demo" / time.strftime("%Y%m%d-%H%M%S")
    dcfg = demo_config(cfg, state)
    ensure_stable(dcfg, warm_start_dir=v1)
    general, code, speed_set = workload_prompts(cfg, speed_prompts, family)
    log(f"workload: {len(general)} general then {len(code)} code held-out prompts; "
         f"{general_s:.0f} s general, {code_s:.0f} s code, {max_tokens} tokens each, {concurrency} clients")

    loop = ClosedLoop(dcfg, run_name="demo").start()
    reg = Registry.from_config(dcfg)
    log(f"ops page (live while the demo runs): {loop.url}/ops")
    try:
        work = Workload(loop.url, max_tokens, concurrency)
        run = run_phases(loop, reg, work, general, code, speed_set, general_s=general_s, code_s=code_s)
        ops_summary = fetch_summary(loop.url)  # what the ops page shows at the end, before the stack goes
    finally:
        loop.stop()

    versions = version_table(run.samples, run.shift, reg)
    log("paired estimate: every version on the same held-out post-shift code records")
    paired = paired_alpha(dcfg, run.records, run.shift, loaded.model, reg)
    report = build_report(run, work.results, versions, paired, general_s=general_s, code_s=code_s)
    report.update({"setup_s": setup_s, "loop_s": time.time() - run.t0, "total_s": time.time() - t_start,
                   "state_dir": str(state), "target": cfg.model.target, "family": family})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["ops"] = save_ops_snapshot(ops_summary, loop.url, out_dir)
    report["by_source"] = ((ops_summary or {}).get("loop") or {}).get("by_source") or []
    # The speed prompts, so the same check can be rerun elsewhere (a GPU) with `osd bench engine`.
    write_prompts(speed_set, out_dir / "speed_prompts.jsonl")
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot(run.samples, run.shift, run.t0, run.controller["decisions"], out_dir / "acceptance.png")
    _print(report, out_dir)
    return report


def prepare(cfg: OSDConfig, family: str = "head") -> tuple[Any, Path]:
    """The target (converted and cached on the first run) and the warm-start draft v1's directory."""
    from infra.target import load_target
    from infra.drafts.spec import warm_start_path

    v1 = warm_start_path(cfg, family)
    log(f"target {cfg.model.target}: preparing (cached after the first run)")
    loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=True)
    if not v1.is_dir():
        from pipeline.teacher.engine import teacher_for
        from train.warm.layer import warm_start_family

        log(f"no warm-started {family} draft yet: running `osd draft init --family {family}` once "
             f"({'up to about 25 minutes' if family == 'head' else 'about 9 minutes'} on 2 cores; cached for later runs)")
        warm_start_family(cfg, family, generate=teacher_for(cfg))
    return loaded, v1


def workload_prompts(cfg: OSDConfig, speed_prompts: int, family: str = "head") -> tuple[list, list, list]:
    """(general, code, speed check) prompts: short held-out ShareGPT prompts, no text twice."""
    from infra.prompts import load_sharegpt, unique_texts
    from train.teacher.sets import warm_prompts

    sharegpt = load_sharegpt(cfg.data)  # parsed once: held-out traffic, v1's prompts, the train top-up
    held = [p for p in sharegpt if p.split == "held_out" and len(p.text) <= 600]
    general = unique_texts([p for p in held if p.domain != "code"])
    code = unique_texts([p for p in held if p.domain == "code"])
    speed_set, code = code[:speed_prompts], code[speed_prompts:]
    # The held-out split has ~100 short code prompts, fewer than the code phase sends: go on with
    # train-split code prompts that v1 never saw, so no prompt repeats. A repeat would be served
    # by a draft already trained on the target's answer to it, and inflate its acceptance.
    # v1's prompts as its warm start chose them (the head's: every human turn), excluded by text.
    wcfg = cfg.for_warm_start(family)
    pool = sharegpt if wcfg.train.warm_turns == "first" else None  # None: parsed again, every turn
    warm_texts = {p.text for p in warm_prompts(wcfg, wcfg.train.warm_prompts, prompts=pool)}
    code = unique_texts(code + [p for p in sharegpt if p.split == "train" and p.domain == "code"
                                and len(p.text) <= 600 and p.text not in warm_texts],
                        exclude={p.text for p in speed_set})
    return general, code, speed_set


@dataclass
class PhaseRun:
    """What the loop's phases left behind, read before the loop stops."""

    t0: float  # start of phase 1 (time.time())
    shift: float  # start of phase 2, the shift to code
    speed: dict[str, Any]  # speed_check's result, with max_tokens
    controller: dict[str, Any]  # the rollout controller's status: decisions, aliases
    samples: list[dict[str, Any]]  # the controller's per-request samples
    records: list  # the run's records, from its private stream
    start_stable: str | None = None  # the stable before phase 1: the warm start v1
    frozen: dict[str, Any] | None = None  # frozen_check's result: the speed check with v1 stable again
    trainer_lag: dict[str, Any] | None = None  # trainer_lag() when traffic ended
    withdrawn_canary: str | None = None  # end_rollout's: the canary left undecided when traffic ended


def run_phases(loop: Any, reg: Any, work: Workload, general: list, code: list, speed_set: list, *,
               general_s: float, code_s: float) -> PhaseRun:
    """General traffic, the shift to code, then the speed check with the final draft and with v1."""

    def status() -> str:
        a = reg.aliases()
        c = a["canary"]
        return f"stable {a['stable']['version']}" + (f", canary {c['version']} at {c['weight']:.0%}" if c else "")

    start_stable = reg.aliases()["stable"]["version"]
    t0 = time.time()
    log("phase 1: general traffic")
    work.run("general", general, general_s, status)
    shift = time.time()
    log(f"phase 2: the traffic shifts to code ({status()})")
    work.run("code", code, code_s, status)
    lag = trainer_lag(_summary(loop.url), loop.cfg.stream.group,
                      sum(r["phase"] == "code" for r in work.results), code_s)
    log(f"traffic ended; the trainer's lag: {lag}")
    # What the loop learned by the end of traffic is what is measured: no candidate appears
    # during the checks, and no decision is taken (their requests leave no records).
    loop.stop_trainer()
    time.sleep(2 * loop.cfg.rollout.poll_s)  # the controller reads the traffic's last requests
    withdrawn = end_rollout(loop, reg)
    if withdrawn:
        time.sleep(2 * loop.cfg.serve.alias_poll_s)  # the replica re-reads the aliases on its own clock
    log(f"speed check: {len(speed_set)} post-shift code prompts, speculative vs autoregressive, same server")
    controller = loop.controller_status()  # the loop's outcome, before the frozen check moves stable
    speed, frozen = final_and_frozen(loop, reg, speed_set, work.max_tokens, start_stable, clients=work.concurrency)
    return PhaseRun(t0, shift, speed, controller, loop.samples(), stream_records(loop.cfg), start_stable, frozen,
                    lag, withdrawn)


def end_rollout(loop: Any, reg: Any) -> str | None:
    """Stop the rollout once traffic has ended, and withdraw a canary it left undecided (the
    version returned, else None). With no more traffic no canary can be decided, and a live one
    serves its share of both speed checks, whose pairs the loop's contribution leaves out: one
    run kept 2 prompts of 12 that way. The canary's version stays in the registry."""
    loop.stop_rollout()
    canary = reg.alias("canary")
    if not canary:
        return None
    reg.clear_canary(expect=canary["version"])
    log(f"traffic ended with canary {canary['version']} undecided: withdrawn, so the speed checks measure "
         f"stable alone")
    return canary["version"]


def _summary(url: str) -> dict[str, Any] | None:
    from serve.api.ops.page import fetch_summary

    return fetch_summary(url)


def trainer_lag(summary: dict[str, Any] | None, group: str, requests: int, seconds: float) -> dict[str, Any]:
    """The trainers' consumer-group lag when traffic ended (records not yet delivered, and
    delivered but unacked), in records and in seconds of the phase's traffic, with the records
    the trainer skipped as stale (train.max_lag_s)."""
    loop = (summary or {}).get("loop") or {}
    found = [g for g in (loop.get("stream") or {}).get("groups", []) if g.get("group") == group]
    if not found or found[0].get("lag") is None:
        return {"records": None, "reason": "the ops summary had no lag for the trainers' group"}
    rate = requests / seconds if seconds > 0 else 0.0
    lag = int(found[0]["lag"])
    skipped = sum(int((t or {}).get("skipped_stale") or 0) for t in loop.get("trainers") or [])
    return {"records": lag, "pending": found[0].get("pending"), "requests_per_s": rate,
            "seconds_of_traffic": lag / rate if rate else None, "skipped_stale": skipped}


def build_report(run: PhaseRun, results: list[dict[str, Any]], versions: list[dict[str, Any]],
                 paired: dict[str, Any], *, general_s: float, code_s: float) -> dict[str, Any]:
    decisions = run.controller["decisions"]
    by_id = {p["version"]: p["alpha_est"] for p in paired["versions"]}
    for v in versions:
        v["alpha_est_post_shift"] = by_id.get(v["version"])
    failed = [r for r in results if not r["ok"]]
    minutes, first = minutes_to_first_promotion(decisions, run.shift)
    frozen = run.frozen or {"skipped": "not run", "pairs": [], "speedup_vs_ar": None}
    return {
        "trainer_lag": run.trainer_lag,
        "failed_requests": len(failed),
        "requests": len(results),
        "promoted": [d["version"] for d in decisions if d["action"] == "promote"],
        "rolled_back": [d["version"] for d in decisions if d["action"] == "rollback"],
        "expired": [d["version"] for d in decisions if d["action"] == "expired"],
        # candidates the offline gate kept from users, with the paired evidence against stable
        "gated": [gated_entry(d) for d in decisions if d["action"] == "gated"],
        "versions": versions,
        "speedup_vs_ar": run.speed["speedup_vs_ar"],
        "paired_post_shift": paired,
        "speed_check": run.speed,
        # time to adapt: from the shift to the first promotion after it
        "minutes_to_first_promotion": minutes,
        "first_promotion": first,
        # the loop's own contribution: the same prompts with v1 stable again (the head frozen)
        "start_stable": run.start_stable,
        "speed_check_frozen": frozen,
        "speedup_vs_ar_frozen": frozen["speedup_vs_ar"],
        "loop_contribution": loop_contribution(run.speed, frozen),
        # what each check's speculative requests drafted: where the two drafts' speeds part
        "drafting_one_request": {"final": drafting(run.speed), "frozen": drafting(frozen)},
        # the same under the demo's eight clients (batched_check): where the head's gain is
        "speedup_vs_ar_batched": throughput_speedup(run.speed.get("batched")),
        "speedup_vs_ar_frozen_batched": throughput_speedup(frozen.get("batched")),
        "loop_contribution_batched": batched_contribution(run.speed, frozen),
        "decisions": [{k: d.get(k) for k in ("time", "action", "version", "reason", "weight")} for d in decisions],
        "final_aliases": run.controller["aliases"],
        "canary_withdrawn_at_end": run.withdrawn_canary,
        "phases": {"general_s": general_s, "code_s": code_s, "shift_time": run.shift, "start_time": run.t0,
                   "requests_general": sum(r["phase"] == "general" for r in results),
                   "requests_code": sum(r["phase"] == "code" for r in results)},
        "errors": [r["error"] for r in failed][:20],
    }


def gated_entry(d: dict[str, Any]) -> dict[str, Any]:
    """A gated candidate for the report: why, and the gate's paired numbers against stable."""
    g = (d.get("evidence") or {}).get("gate") or {}
    keep = ("stable", "records", "positions", "candidate_alpha", "stable_alpha", "diff", "lower", "upper")
    return {"version": d["version"], "reason": d.get("reason"), **{k: g.get(k) for k in keep}}


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _steps(drafting: dict[str, Any]) -> str:
    """A check's drafting steps by who proposed, as `head 12, suffix 340` (`-` where not reported)."""
    steps = drafting.get("steps_by_source") or {}
    return ", ".join(f"{src} {n:.0f}" for src, n in sorted(steps.items())) or "-"


def _print_loop_gain(r: dict[str, Any]) -> None:
    """Time to adapt, and the final draft against v1 on the same prompts."""
    m = r["minutes_to_first_promotion"]
    print("time to adapt: " + ("no promotion after the shift" if m is None else
                               f"{m:.1f} minutes from the shift to promoting {r['first_promotion']}"))
    lag = r.get("trainer_lag") or {}
    if lag.get("records") is not None:
        secs = lag.get("seconds_of_traffic")
        print(f"trainer lag when traffic ended: {lag['records']} records ({_num(secs, '.0f')} s of traffic), "
              f"{lag['skipped_stale']} skipped as stale")
    if r.get("canary_withdrawn_at_end"):
        print(f"canary {r['canary_withdrawn_at_end']} was undecided when traffic ended: withdrawn before the speed checks")
    fz, lc = r["speed_check_frozen"], r["loop_contribution"]
    if fz.get("skipped"):
        print(f"frozen check (v1 stable again): skipped, {fz['skipped']}")
        return
    print(f"speed-up vs AR, final {fz['final_version']} vs frozen {fz['version']}: "
          f"{_times(r['speedup_vs_ar'])} vs {_times(r['speedup_vs_ar_frozen'])}")
    if lc.get("skipped"):
        print(f"loop contribution: n/a ({lc['skipped']})")
    else:
        print(f"loop contribution (final minus frozen speed-up, mean over {lc['n']} prompts): {lc['mean']:+.3f}, "
              f"{lc['level']:.0%} bootstrap interval [{lc['lower']:+.3f}, {lc['upper']:+.3f}] (median {lc['median']:+.3f})")
    dr = r.get("drafting_one_request") or {}
    if dr.get("final") and dr.get("frozen"):
        f, z = dr["final"], dr["frozen"]
        print(f"drafting at one request, final vs frozen: {f['draft_per_output']:.2f} vs {z['draft_per_output']:.2f} "
              f"draft tokens an output token, {_num(f['acceptance'])} vs {_num(z['acceptance'])} of them accepted; "
              f"drafting steps by source {_steps(f)} vs {_steps(z)}")
    lb = r.get("loop_contribution_batched") or {}
    if "mean" in lb:
        print(f"batched ({(r['speed_check'].get('batched') or {}).get('clients')} clients): throughput speed-up vs AR "
              f"{_times(r['speedup_vs_ar_batched'])} vs {_times(r['speedup_vs_ar_frozen_batched'])} (means of "
              f"{len(lb['rounds_final'])} and {len(lb['rounds_frozen'])} rounds), loop contribution {lb['mean']:+.3f}, "
              f"range over round pairs [{lb['lower']:+.3f}, {lb['upper']:+.3f}]")
    if fz.get("canary_during"):
        print(f"  canary {fz['canary_during']} was live during the frozen check")
    if lc.get("served_by_another_version"):
        print(f"  {lc['served_by_another_version']} speed measurements served by a version other than the one "
              f"checked were left out")
    for d in fz.get("decisions_during") or []:
        print(f"  during the frozen check the controller decided: {d['action']} {d['version']} ({d['reason']})")


def _print(r: dict[str, Any], out_dir: Path) -> None:
    rows = [[v["version"], v["parent"] or "-", v["requests"], v["alpha"], v["alpha_pre_shift"],
             v["alpha_post_shift"], v["alpha_est"], v.get("alpha_est_post_shift")] for v in r["versions"]]
    print("\n" + tabulate(rows, headers=["version", "parent", "requests", "alpha", "pre-shift", "post-shift",
                                        "alpha_est", "paired post"], floatfmt=".3f", missingval="-"))
    pp = r.get("paired_post_shift") or {}
    print(f"\npaired post: every version's acceptance estimate on the same {pp.get('records', 0)} held-out "
          f"post-shift code records ({pp.get('positions', 0)} positions), which no version trained on")
    for v in pp.get("versions", []):
        print(f"  {v['version']:<16}parent {str(v['parent'] or '-'):<16}records {v['records_consumed'] or 0:>6}"
              f"  alpha_est {v['alpha_est']:.3f}  greedy agreement {_num(v.get('greedy_est'))}")
    for g in r.get("gated", []):
        iv = "-" if g["lower"] is None else f"[{g['lower']:+.3f}, {g['upper']:+.3f}]"
        print(f"  gated {g['version']:<16}vs {str(g['stable'] or '-'):<16}records {g['records'] or 0:>4}  "
              f"paired diff interval {iv}")
    if r.get("by_source"):
        print("\ndrafting steps by who proposed (served requests, all phases)")
        for row in r["by_source"]:
            print(f"  {row['draft_version']:<16}{row['source']:<8}steps {row['steps']:>7}  acceptance "
                  f"{_num(row['acceptance'])}  tokens/step {_num(row['tokens_per_step'], '.2f')}")
    sp = r["speedup_vs_ar"]
    print(f"\nrequests {r['requests']}, failed {r['failed_requests']}; promoted {r['promoted'] or '-'}; "
          f"rolled back {r['rolled_back'] or '-'}; expired {r.get('expired') or '-'}; "
          f"gated {[g['version'] for g in r.get('gated', [])] or '-'}")
    print(f"post-shift speed-up vs AR (median of per-prompt ratios): {_times(sp)}")
    _print_loop_gain(r)
    print(f"same prompts elsewhere: osd bench engine --prompts-file {out_dir / 'speed_prompts.jsonl'} "
          f"--max-new-tokens {r['speed_check']['max_tokens']} --draft <a version's directory> [--device cuda]")
    ops = r.get("ops") or {}
    if ops.get("snapshot"):
        print(f"ops page snapshot: {out_dir / ops['snapshot']} (the live page was {ops['page']})")
    print(f"wrote {out_dir / 'report.json'} and {out_dir / 'acceptance.png'} "
          f"(setup {r['setup_s']:.0f} s, loop {r['loop_s']:.0f} s, total {r['total_s']:.0f} s)", flush=True)
