"""`make demo`'s speed checks: each post-shift prompt with speculation and without on the same
server, with the loop's final draft and with v1 (frozen), one request at a time and batched, and
what the differences say (the loop's contribution, with its interval).

The rules, and why, are docs/loop.md's; pipeline/traffic/demo.py runs them after the traffic.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from pipeline.traffic.replay import build_body, parse_response


def log(msg: str) -> None:
    """A line of `make demo`'s progress (the demo's own lines too)."""
    print(f"[osd demo] {msg}", flush=True)


def post_chat(url: str, text: str, max_tokens: int, timeout: float = 300, **extra: Any) -> dict[str, Any]:
    """One greedy chat completion; {"ok", "latency_s", "tokens", "version", "mean_accepted_len",
    "draft_tokens", "accepted_tokens", "by_source"} or {"ok": False, "latency_s", "error"}; by_source: its
    drafting steps by who proposed (the `osd` field's drafted_by_source: source -> {"steps",
    "drafted", "accepted"})."""
    body = {**build_body(text, chat=True, max_tokens=max_tokens, temperature=0.0, record=None), **extra}
    t0 = time.perf_counter()
    try:
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
        if resp.status_code >= 400:  # a refusal (429, 503) or an error is a failed request, as any other
            return {"ok": False, "latency_s": time.perf_counter() - t0,
                    "error": f"HTTP {resp.status_code}: {resp.text.strip()[:200]}"}
        fields = parse_response(resp.json(), chat=True)
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
        return {"ok": False, "latency_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "latency_s": time.perf_counter() - t0, "tokens": fields["completion_tokens"],
            "version": fields["draft_version"], "mean_accepted_len": fields["mean_accepted_len"],
            "draft_tokens": fields["num_draft_tokens"], "accepted_tokens": fields["num_accepted_tokens"],
            "by_source": fields["drafted_by_source"]}


def speed_check(url: str, prompts: list, max_tokens: int, salt: str = "osd-demo-speed") -> dict[str, Any]:
    """Each prompt with and without speculation, order alternating; tokens/s per request.
    Each mode sends its own cache_salt (`salt`-on, `salt`-off; a check of its own takes
    another `salt`), so the second request of a prompt does not start from the first one's
    prefill in the server's prefix cache, nor a check from an earlier check's."""
    got: dict[bool, list] = {True: [], False: []}
    for i, p in enumerate(prompts):
        for spec in ([True, False] if i % 2 == 0 else [False, True]):
            got[spec].append(_ask(url, p, max_tokens, spec, salt))
    return _paired(prompts, got[True], got[False])


# Batched checks a round: each is one sample of the machine's moment, which every prompt of it
# shares (a round's prompts run in the same steps), so rounds, not prompts, carry its noise.
BATCHED_REPEATS = 2
# ...and so a batched check sends the speed set's first prompts only: more would lengthen each
# round without adding rounds. The one-request check sends them all: its noise is per prompt.
BATCHED_PROMPTS = 12


def batched_check(url: str, prompts: list, max_tokens: int, salt: str, clients: int,
                  on_first: bool = True) -> dict[str, Any]:
    """The speed check under the demo's traffic shape: every prompt sent by `clients` clients at
    once with speculation, then every one without (or the other way round). Per request its
    tokens/s (pairs), and per mode the round's throughput, its tokens over the seconds from the
    first request to the last answer (`throughput`, and the ratio in `round_ratios`): a
    request's own rate in a batch counts its wait for the others, so the round is the unit
    that compares the modes. The head's gain is in batched steps, which one request at a time
    does not show."""
    got, took = {}, {}
    for spec in ([True, False] if on_first else [False, True]):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            got[spec] = list(pool.map(lambda p, spec=spec: _ask(url, p, max_tokens, spec, salt), prompts))
        took[spec] = time.perf_counter() - t0
    rate = {spec: sum(r["tokens"] for r in got[spec] if r["ok"]) / took[spec] if took[spec] > 0 else 0.0
            for spec in got}
    ratio = rate[True] / rate[False] if rate[True] and rate[False] else None
    return dict(_paired(prompts, got[True], got[False]), clients=clients,
                throughput={"sd_tok_s": rate[True], "ar_tok_s": rate[False], "ratio": ratio},
                round_ratios=[ratio] if ratio is not None else [])


def throughput_speedup(check: dict[str, Any] | None) -> float | None:
    """The batched check's speed-up: the mean over its rounds of speculative over autoregressive
    throughput (None without a round)."""
    ratios = (check or {}).get("round_ratios") or []
    return statistics.fmean(ratios) if ratios else None


def _ask(url: str, p: Any, max_tokens: int, spec: bool, salt: str) -> dict[str, Any]:
    """One speed-check request: unrecorded, each mode with its own cache salt."""
    return post_chat(url, p.text, max_tokens, osd_speculate=spec, osd_record=False,
                     cache_salt=f"{salt}-{'on' if spec else 'off'}")


def _paired(prompts: list, on: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """Per prompt, its speculative and autoregressive answers' tokens/s and their ratio, and
    what the speculative one drafted (draft tokens, accepted tokens)."""
    pairs = []
    for p, a, b in zip(prompts, on, off):
        if a["ok"] and b["ok"] and a["tokens"] and b["tokens"]:
            sd, ar = a["tokens"] / a["latency_s"], b["tokens"] / b["latency_s"]
            pairs.append({"prompt": p.id, "sd_tok_s": sd, "ar_tok_s": ar, "ratio": sd / ar,
                          "version": a["version"], "tokens": a["tokens"],
                          "draft_tokens": a.get("draft_tokens", 0), "accepted_tokens": a.get("accepted_tokens", 0),
                          "by_source": a.get("by_source") or {}})
    return {"pairs": pairs, **_medians(pairs)}


def drafting(check: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a check's speculative requests drafted, over all its pairs: draft tokens per output
    token, the share accepted, and the drafting steps by who proposed (`steps_by_source`; a
    hybrid's head and suffix draft), None without pairs."""
    pairs = (check or {}).get("pairs") or []
    out, drafted = sum(p.get("tokens", 0) for p in pairs), sum(p.get("draft_tokens", 0) for p in pairs)
    if not pairs or not out:
        return None
    accepted = sum(p.get("accepted_tokens", 0) for p in pairs)
    steps = source_steps(pairs)
    return {"draft_per_output": drafted / out, "acceptance": accepted / drafted if drafted else None,
            "accepted_per_output": accepted / out, "steps_by_source": steps}


def source_steps(pairs: list[dict[str, Any]]) -> dict[str, float]:
    """Drafting steps by who proposed, summed over pairs (a merged pair's are its rounds' mean)."""
    out: dict[str, float] = {}
    for p in pairs:
        for src, got in (p.get("by_source") or {}).items():
            out[src] = out.get(src, 0) + got["steps"]
    return out


def _medians(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The check's figures over its pairs: the median ratio and tokens/s (speedup_vs_ar None
    without pairs)."""
    if not pairs:
        return {"speedup_vs_ar": None}
    return {"speedup_vs_ar": statistics.median(p["ratio"] for p in pairs),
            "sd_tok_s_median": statistics.median(p["sd_tok_s"] for p in pairs),
            "ar_tok_s_median": statistics.median(p["ar_tok_s"] for p in pairs)}


def _mean_by_source(pairs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The rounds' drafting by source for one prompt, as the mean of its rounds (each field)."""
    out: dict[str, dict[str, float]] = {}
    for p in pairs:
        for src, got in (p.get("by_source") or {}).items():
            acc = out.setdefault(src, {})
            for f, v in got.items():
                acc[f] = acc.get(f, 0.0) + v / len(pairs)
    return out


def merge_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of the speed check as one: per prompt and version, the mean of each round's tok/s
    and ratio. The rounds of the final and the frozen check alternate (final, frozen, frozen,
    final), so a machine that drifts faster or slower during the checks moves both alike."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in checks:
        for p in c["pairs"]:
            by.setdefault((p["prompt"], p["version"]), []).append(p)
    pairs = [{"prompt": k[0], "version": k[1], "rounds": len(ps),
              **{f: statistics.fmean(p.get(f, 0) for p in ps)
                 for f in ("sd_tok_s", "ar_tok_s", "ratio", "tokens", "draft_tokens", "accepted_tokens")},
              "by_source": _mean_by_source(ps)}
             for k, ps in by.items()]
    out: dict[str, Any] = {"pairs": pairs, **_medians(pairs), "rounds": len(checks),
                           "round_speedups": [c.get("speedup_vs_ar") for c in checks]}
    if any("round_ratios" in c for c in checks):  # batched checks: their rounds' throughput ratios
        out["round_ratios"] = [x for c in checks for x in c.get("round_ratios", [])]
    if all("batched" in c for c in checks):
        out["batched"] = dict(merge_checks([c["batched"] for c in checks]), clients=checks[0]["batched"]["clients"])
    return out


def bootstrap_median(values: list[float], *, resamples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict[str, Any] | None:
    """The median of `values` with a percentile-bootstrap interval of it, reproducible by seed;
    None for no values."""
    return _bootstrap(values, np.median, "median", resamples=resamples, seed=seed, level=level)


def bootstrap_mean(values: list[float], *, resamples: int = 2000, seed: int = 0,
                   level: float = 0.95) -> dict[str, Any] | None:
    """The mean of `values` with a percentile-bootstrap interval of it, as bootstrap_median."""
    return _bootstrap(values, np.mean, "mean", resamples=resamples, seed=seed, level=level)


def _bootstrap(values: list[float], stat: Any, name: str, *, resamples: int, seed: int,
               level: float) -> dict[str, Any] | None:
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return None
    rng = np.random.default_rng(seed)
    draws = stat(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    tail = (1.0 - level) / 2
    lower, upper = np.quantile(draws, [tail, 1.0 - tail])
    return {name: float(stat(x)), "lower": float(lower), "upper": float(upper), "n": int(x.size),
            "level": level, "resamples": resamples, "seed": seed}


def loop_contribution(final: dict[str, Any], frozen: dict[str, Any]) -> dict[str, Any]:
    """Per prompt, the speed-up with the final draft minus the speed-up with v1 on the same
    server: what the loop's training added beyond the suffix index both share. Only prompts
    that the final stable served in the one check and v1 in the other count (a live canary
    takes its share of either). The figure is the mean of the differences, with a bootstrap
    interval over prompts (the median is reported beside it): their spread is mostly
    single-request timing noise, about symmetric, where the mean's interval is the narrower
    (docs/loop.md)."""
    if frozen.get("skipped"):
        return {"skipped": frozen["skipped"], "per_prompt": []}
    final_ratio = {p["prompt"]: p["ratio"] for p in final["pairs"] if p["version"] == frozen["final_version"]}
    frozen_ratio = {p["prompt"]: p["ratio"] for p in frozen["pairs"] if p["version"] == frozen["version"]}
    per_prompt = [{"prompt": k, "final": final_ratio[k], "frozen": frozen_ratio[k],
                   "diff": final_ratio[k] - frozen_ratio[k]} for k in final_ratio if k in frozen_ratio]
    served_by_other = (len(final["pairs"]) - len(final_ratio)) + (len(frozen["pairs"]) - len(frozen_ratio))
    diffs = [d["diff"] for d in per_prompt]
    interval = bootstrap_mean(diffs)
    median = {"median": statistics.median(diffs)} if diffs else {}
    return {"skipped": None if per_prompt else "no prompt measured with both drafts", **(interval or {}), **median,
            "served_by_another_version": served_by_other, "per_prompt": per_prompt}


def batched_contribution(final: dict[str, Any], frozen: dict[str, Any]) -> dict[str, Any]:
    """The loop's contribution under batching: the final draft's batched speed-up
    (throughput_speedup) minus v1's, with the range of the differences over every pair of a
    final and a frozen round. Not a bootstrap over prompts: a round's prompts share its steps
    and the machine's moment, so they move together (in-process, rounds of the same two
    drafts read 0.62x to 1.35x), and an interval over them would be far narrower than the
    truth. Each round's per-prompt pairs stay in the check."""
    if frozen.get("skipped"):
        return {"skipped": frozen["skipped"]}
    if "batched" not in final or "batched" not in frozen:
        return {"skipped": "no batched check ran"}
    f, z = final["batched"].get("round_ratios") or [], frozen["batched"].get("round_ratios") or []
    if not f or not z:
        return {"skipped": "no batched round measured both modes with each draft"}
    diffs = [a - b for a in f for b in z]
    # a round's throughput counts every answer; a live canary's share is reported, not left out
    other = (sum(p["version"] != frozen.get("final_version") for p in final["batched"].get("pairs", []))
             + sum(p["version"] != frozen.get("version") for p in frozen["batched"].get("pairs", [])))
    return {"skipped": None, "mean": statistics.fmean(f) - statistics.fmean(z), "lower": min(diffs),
            "upper": max(diffs), "rounds_final": f, "rounds_frozen": z, "served_by_another_version": other}


def frozen_skip_reason(start_stable: str | None, end_stable: str | None, start_kept: bool = True) -> str | None:
    """Why the frozen check cannot run, or None when it can."""
    if start_stable is None:
        return "no stable version at the start of the run to go back to"
    if end_stable == start_stable:
        return f"stable is still {start_stable}: nothing was promoted, so the final draft is the frozen one"
    if not start_kept:  # the trainer's registry gc keeps registry.keep_last versions besides the aliased ones
        return f"{start_stable} is no longer in the registry (garbage-collected)"
    return None


def wait_until_served(url: str, version: str, *, timeout_s: float, poll_s: float) -> float | None:
    """Seconds until a request is served by `version`, None if none is within timeout_s: the
    replica re-reads the aliases on its own clock and loads the version before it swaps."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        r = post_chat(url, "Hello", 1, timeout=timeout_s, osd_record=False)
        if r["ok"] and r["version"] == version:
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


def frozen_check(loop: Any, reg: Any, prompts: list, max_tokens: int, frozen: str | None, *,
                 wait_s: float = 60.0, rounds: int = 1, clients: int = 0) -> dict[str, Any]:
    """The speed check again with v1 stable (`rounds` times, merged), then the loop's stable put
    back; with `clients`, each round also runs the batched check (`batched`). The demo stops the
    rollout first (end_rollout); a canary or a decision that a running controller made during
    the check is still reported. A registry that refuses the move costs this check only, never
    the report."""
    from infra.registry import RegistryError

    before = reg.aliases()
    final = (before["stable"] or {}).get("version")
    skipped = frozen_skip_reason(frozen, final, frozen is not None and reg.exists(frozen))
    out: dict[str, Any] = {"version": frozen, "final_version": final, "skipped": skipped,
                           "canary_during": (before["canary"] or {}).get("version"), "pairs": [],
                           "speedup_vs_ar": None}
    if out["skipped"]:
        log(f"frozen check skipped: {out['skipped']}")
        return out
    n_decisions = len(loop.controller_status()["decisions"])
    try:
        reg.set_stable(frozen, reason="osd demo: the frozen check measures v1 again; the loop's stable comes back after")
    except RegistryError as e:
        out["skipped"] = f"could not make {frozen} stable ({type(e).__name__}: {e})"
        log(f"frozen check skipped: {out['skipped']}")
        return out
    try:
        waited = wait_until_served(loop.url, frozen, timeout_s=wait_s, poll_s=loop.cfg.serve.alias_poll_s / 2)
        if waited is None:
            out["skipped"] = f"the replica did not serve {frozen} within {wait_s:.0f} s of the alias move"
        else:
            log(f"frozen check: {frozen} serves again after {waited:.1f} s; the same {len(prompts)} prompts")
            checks = [check_round(loop.url, prompts, max_tokens, f"osd-demo-frozen{_round(i, rounds)}", clients,
                                  on_first=i % 2 == 1) for i in range(rounds)]
            out.update(checks[0] if rounds == 1 else merge_checks(checks), waited_s=waited)
    finally:
        out.update(restore_stable(reg, frozen, final))
    status = loop.controller_status()
    out["canary_during"] = out["canary_during"] or (status["aliases"]["canary"] or {}).get("version")
    out["decisions_during"] = [{k: d.get(k) for k in ("time", "action", "version", "reason")}
                               for d in status["decisions"][n_decisions:]]
    return out


def check_round(url: str, prompts: list, max_tokens: int, salt: str, clients: int = 0,
                on_first: bool = True) -> dict[str, Any]:
    """One round: the one-request speed check, and with `clients` the batched check (`batched`)
    over the first BATCHED_PROMPTS prompts, BATCHED_REPEATS times, its modes' order alternating."""
    out = speed_check(url, prompts, max_tokens, salt=salt)
    if clients:
        runs = [batched_check(url, prompts[:BATCHED_PROMPTS], max_tokens,
                              f"{salt}-batched{'' if j == 0 else f'-{j + 1}'}", clients,
                              on_first if j % 2 == 0 else not on_first) for j in range(BATCHED_REPEATS)]
        out["batched"] = dict(merge_checks(runs), clients=clients) if len(runs) > 1 else runs[0]
    return out


def _round(i: int, rounds: int) -> str:
    """The salt's suffix of round i: none for a single round (the salts runs before used)."""
    return "" if rounds == 1 else f"-{i + 1}"


def restore_stable(reg: Any, frozen: str, final: str) -> dict[str, Any]:
    """Stable back to the loop's draft, unless the controller moved it during the check (its
    decision stands)."""
    from infra.registry import RegistryError

    try:
        now = reg.alias("stable")["version"]
        if now != frozen:
            log(f"frozen check: the controller moved stable to {now} meanwhile; left there")
            return {"restored": False, "stable_after": now}
        reg.set_stable(final, reason="osd demo: the frozen check is done; the loop's stable is back")
    except RegistryError as e:  # the run's report still matters more than the alias it leaves
        log(f"frozen check: could not put {final} back as stable ({type(e).__name__}: {e}); "
             f"`osd registry promote {final}` does")
        return {"restored": False, "stable_after": None, "restore_error": f"{type(e).__name__}: {e}"}
    return {"restored": True, "stable_after": final}


def final_and_frozen(loop: Any, reg: Any, prompts: list, max_tokens: int, start_stable: str | None,
                     *, wait_s: float = 60.0, clients: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The speed check with the loop's final stable and with v1 (frozen), as final, frozen,
    frozen, final: one run's final check ran with own AR at 130 tok/s where the frozen check
    right after had 160, so back-to-back checks compare the machine's moments, not the drafts.
    The second final round runs only if the loop's stable is served again. With `clients`,
    each round also runs the batched check, its modes' order alternating too."""
    final = dict(check_round(loop.url, prompts, max_tokens, "osd-demo-final-1", clients), max_tokens=max_tokens)
    frozen = frozen_check(loop, reg, prompts, max_tokens, start_stable, wait_s=wait_s, rounds=2, clients=clients)
    if frozen.get("skipped") or not frozen.get("restored"):
        return final, frozen
    back = wait_until_served(loop.url, frozen["final_version"], timeout_s=wait_s,
                             poll_s=loop.cfg.serve.alias_poll_s / 2)
    if back is None:
        log(f"the replica did not serve {frozen['final_version']} again within {wait_s:.0f} s: one final round")
        return final, frozen
    again = check_round(loop.url, prompts, max_tokens, "osd-demo-final-2", clients, on_first=False)
    return dict(merge_checks([final, again]), max_tokens=max_tokens), frozen
