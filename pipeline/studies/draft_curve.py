"""`osd draft curve`: held-out agreement against warm-start tokens, over head drafts that one
resumable `osd draft init` made at growing budgets (the teacher cache keeps what each run
generated, so each larger budget trains on a superset of the last one's answers).

Each published head's draft.json holds what is plotted: its training tokens (metrics
train_tokens), its held-out greedy agreement per depth and its estimated tokens a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


class CurveError(ValueError):
    pass


def curve_point(draft_dir: str | Path) -> dict[str, Any]:
    """One head's figures from its draft.json; a clear error for anything else."""
    path = Path(draft_dir) / "draft.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CurveError(f"{draft_dir}: no readable draft.json ({e})") from None
    m, lineage = meta.get("metrics") or {}, meta.get("lineage") or {}
    if lineage.get("family") != "head" or "train_tokens" not in m or not m.get("agree_per_depth"):
        raise CurveError(f"{draft_dir}: not a warm-started head with its training tokens and agreement")
    return {"draft": str(draft_dir), "train_tokens": int(m["train_tokens"]),
            "teacher_records": lineage.get("teacher_records"), "conversations": lineage.get("conversations"),
            "agree_per_depth": m["agree_per_depth"], "depth1": m["agree_per_depth"][0],
            "tokens_per_step_est": m.get("tokens_per_step_est"), "coverage": m.get("coverage"),
            "held_out_records": m.get("held_out_records"), "train_s": m.get("train_s")}


def draft_curve(draft_dirs: Sequence[str | Path], json_path: str | Path, png_path: str | Path | None) -> list[dict]:
    points = sorted((curve_point(d) for d in draft_dirs), key=lambda p: p["train_tokens"])
    if not points:
        raise CurveError("no head drafts given")
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps({"points": points}, indent=2) + "\n")
    if png_path is not None:
        _plot(points, Path(png_path))
    for p in points:
        per = " / ".join(f"{a:.3f}" for a in p["agree_per_depth"])
        print(f"{p['train_tokens']:>9} tokens  agreement {per}  est. tokens/step {p['tokens_per_step_est']:.2f}  "
              f"{p['draft']}")
    return points


def _plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["train_tokens"] for p in points]
    for depth in range(len(points[0]["agree_per_depth"])):
        ax.plot(xs, [p["agree_per_depth"][depth] for p in points], marker="o", label=f"depth {depth + 1}")
    ax.set_xscale("log")
    ax.set_xlabel("warm-start training tokens")
    ax.set_ylabel("held-out greedy agreement")
    ax.set_title("head warm start: agreement against tokens")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
