"""Server-side SVG charts for the ops page: no chart library, no script, nothing fetched, so the
page works offline and a saved copy (the demo's snapshot) looks the same as the live one.

Each function returns one <svg> element as a string; every value in it is escaped or numeric.
"""

from __future__ import annotations

import html
import time
from typing import Sequence

W, H = 560, 220
PAD_L, PAD_R, PAD_T, PAD_B = 44, 12, 12, 28
COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"]
MARKER_COLORS = {"promote": "#16a34a", "rollback": "#dc2626", "expired": "#a16207", "start": "#2563eb",
                 "advance": "#0891b2", "gated": "#6b7280"}


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _frame(title: str, body: list[str], legend: Sequence[tuple[str, str]], y_ticks: list[tuple[float, str]],
           y_of, x_labels: list[tuple[float, str]]) -> str:
    out = [f'<svg class="chart" role="img" aria-label="{_esc(title)}" viewBox="0 0 {W} {H + 18 * len(legend)}" '
           f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11">',
           f"<title>{_esc(title)}</title>"]
    for v, label in y_ticks:
        y = y_of(v)
        out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        out.append(f'<text x="{PAD_L - 4}" y="{y + 4:.1f}" text-anchor="end" fill="#6b7280">{_esc(label)}</text>')
    for x, label in x_labels:
        out.append(f'<text x="{x:.1f}" y="{H - 8}" text-anchor="middle" fill="#6b7280">{_esc(label)}</text>')
    out.extend(body)
    for i, (name, color) in enumerate(legend):
        y = H + 4 + 18 * i
        out.append(f'<rect x="{PAD_L}" y="{y}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{PAD_L + 16}" y="{y + 9}">{_esc(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def _clock(t: float, span: float) -> str:
    return time.strftime("%H:%M:%S" if span < 600 else "%H:%M", time.gmtime(t))  # UTC, as the page's times


def _x_scale(t0: float, t1: float):
    span = max(t1 - t0, 1e-9)
    return lambda t: PAD_L + (W - PAD_L - PAD_R) * (t - t0) / span


def _y_scale(lo: float, hi: float):
    span = max(hi - lo, 1e-9)
    return lambda v: PAD_T + (H - PAD_T - PAD_B) * (1 - (v - lo) / span)


def _time_labels(t0: float, t1: float, x_of) -> list[tuple[float, str]]:
    return [(x_of(t0 + (t1 - t0) * i / 4), _clock(t0 + (t1 - t0) * i / 4, t1 - t0)) for i in range(5)]


def line_chart(title: str, series: dict[str, list[list]], t0: float, t1: float, *, lo: float = 0.0,
               hi: float = 1.0, markers: Sequence[dict] = ()) -> str:
    """series: {name: [[time, value or None]]}; a None breaks the line. markers: audit decisions."""
    x_of, y_of = _x_scale(t0, t1), _y_scale(lo, hi)
    body, legend = [], []
    for i, (name, points) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        legend.append((name, color))
        runs: list[list[str]] = [[]]
        for t, v in points:
            if v is None:
                runs.append([])
                continue
            runs[-1].append(f"{x_of(t):.1f},{y_of(min(max(v, lo), hi)):.1f}")
            body.append(f'<circle class="point" cx="{x_of(t):.1f}" cy="{y_of(min(max(v, lo), hi)):.1f}" r="2" fill="{color}"/>')
        for run in runs:
            if len(run) > 1:
                body.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.5" '
                            f'points="{" ".join(run)}"/>')
    for m in markers:
        x, color = x_of(m["time"]), MARKER_COLORS.get(m["action"], "#6b7280")
        body.append(f'<line class="marker" x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{H - PAD_B}" stroke="{color}" '
                    f'stroke-dasharray="3,3"><title>{_esc(m["action"])} {_esc(m["version"])}: '
                    f'{_esc(m.get("reason", ""))}</title></line>'
                    f'<text x="{x + 2:.1f}" y="{PAD_T + 9}" fill="{color}">{_esc(m["action"])}</text>')
    ticks = [(lo + (hi - lo) * i / 4, f"{lo + (hi - lo) * i / 4:.2f}") for i in range(5)]
    return _frame(title, body, legend, ticks, y_of, _time_labels(t0, t1, x_of))


def step_chart(title: str, points: list[list[float]], t0: float, t1: float) -> str:
    """points: [[time, value]] of a step function in [0, 1] (the canary weight)."""
    x_of, y_of = _x_scale(t0, t1), _y_scale(0.0, 1.0)
    path, prev = [], None
    for t, v in points:
        if prev is not None:
            path.append(f"{x_of(t):.1f},{y_of(prev):.1f}")
        path.append(f"{x_of(t):.1f},{y_of(v):.1f}")
        prev = v
    body = [f'<polyline class="series" fill="none" stroke="{COLORS[0]}" stroke-width="2" points="{" ".join(path)}"/>']
    ticks = [(v, f"{v:.0%}") for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return _frame(title, body, [("canary weight", COLORS[0])], ticks, y_of, _time_labels(t0, t1, x_of))


def bar_chart(title: str, groups: dict[str, list[float]]) -> str:
    """groups: {version: [value per position]}; bars side by side per position, in [0, 1]."""
    y_of = _y_scale(0.0, 1.0)
    n_pos = max((len(v) for v in groups.values()), default=0)
    body, legend, x_labels = [], [], []
    slot = (W - PAD_L - PAD_R) / max(n_pos, 1)
    bar = slot * 0.8 / max(len(groups), 1)
    for i, (name, values) in enumerate(groups.items()):
        color = COLORS[i % len(COLORS)]
        legend.append((name, color))
        for j, v in enumerate(values):
            x = PAD_L + slot * j + slot * 0.1 + bar * i
            body.append(f'<rect class="bar" x="{x:.1f}" y="{y_of(v):.1f}" width="{bar:.1f}" '
                        f'height="{y_of(0) - y_of(v):.1f}" fill="{color}"><title>{_esc(name)} position {j + 1}: '
                        f'{v:.3f}</title></rect>')
    x_labels = [(PAD_L + slot * (j + 0.5), f"pos {j + 1}") for j in range(n_pos)]
    ticks = [(v, f"{v:.2f}") for v in (0.0, 0.25, 0.5, 0.75, 1.0)]
    return _frame(title, body, legend, ticks, y_of, x_labels)
