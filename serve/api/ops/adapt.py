"""Time to adapt: when the traffic's domain mix last shifted, how long the loop took to promote a
draft after it, and what that promotion brought. Pure functions over (time, domain) points,
audit entries and evidence, for the ops page and its gauges.

A shift is where the domain mix of the SHIFT_WINDOW records before a point and of the
SHIFT_WINDOW after it differ by at least SHIFT_TV in total variation (half the L1 distance
between the two mixes: 0 for the same mix, 1 for disjoint ones). The gain is measured on the
traffic after the shift: the promoted version's acceptance there minus that of the version it
replaced, each over its own records (the canary served both).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

SHIFT_WINDOW = 40  # records on each side of a candidate shift point
SHIFT_TV = 0.4  # total variation of the two sides' mixes that counts as a shift


def total_variation(a: Counter, b: Counter) -> float:
    """Half the L1 distance between two normalised histograms (0 if either is empty)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def last_shift(points: Sequence[tuple[float, str]], window: int = SHIFT_WINDOW,
               threshold: float = SHIFT_TV) -> dict[str, Any] | None:
    """The latest shift in `points` ((time, domain), oldest first): the time of the first record
    after it, the mixes before and after, and their distance; None if the mix never moved
    that much. Of a run of neighbouring points over the threshold, the one of largest
    distance is the shift (the run is one change seen from several points)."""
    n = len(points)
    if n < 2 * window:
        return None
    before = Counter(d for _, d in points[:window])
    after = Counter(d for _, d in points[window:2 * window])
    best: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    for i in range(window, n - window + 1):
        if i > window:  # slide both windows one record on
            before[points[i - window - 1][1]] -= 1
            before[points[i - 1][1]] += 1
            after[points[i - 1][1]] -= 1
            after[points[i + window - 1][1]] += 1
        tv = total_variation(+before, +after)
        if tv >= threshold:
            best = (tv, i) if best is None or tv > best[0] else best
        elif best is not None:
            last, best = best, None
    last = best or last
    if last is None:
        return None
    tv, i = last
    mix = lambda c: {k: round(v / sum(c.values()), 3) for k, v in sorted(c.items())}  # noqa: E731
    return {"time": points[i][0], "distance": round(tv, 3),
            "before": mix(Counter(d for _, d in points[i - window:i])),
            "after": mix(Counter(d for _, d in points[i:i + window]))}


def time_to_adapt(shift: dict[str, Any] | None, audit: Sequence[dict[str, Any]],
                  acceptance_after: dict[str, float], now: float) -> dict[str, Any] | None:
    """The loop's answer to `shift`: the first promotion after it, the minutes it took, and its
    gain in acceptance over the version it replaced (`acceptance_after`: each version's
    acceptance on records after the shift; None where either has none). Without a promotion
    yet, the minutes waited so far."""
    if shift is None:
        return None
    promotions = sorted((e for e in audit if e.get("action") == "promote" and "time" in e),
                        key=lambda e: float(e["time"]))
    before = [e for e in promotions if float(e["time"]) < shift["time"]]
    replaced = before[-1].get("version") if before else None
    first = next((e for e in promotions if float(e["time"]) >= shift["time"]), None)
    if first is None:
        return {"shift": shift, "promoted": None, "waiting_min": round((now - shift["time"]) / 60.0, 2),
                "minutes": None, "gain": None, "replaced": replaced}
    version = first.get("version")
    gain = None
    if version in acceptance_after and replaced in acceptance_after:
        gain = round(acceptance_after[version] - acceptance_after[replaced], 4)
    return {"shift": shift, "promoted": version, "minutes": round((float(first["time"]) - shift["time"]) / 60.0, 2),
            "waiting_min": None, "gain": gain, "replaced": replaced}
