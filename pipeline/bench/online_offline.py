"""`osd bench engine`: a head draft online against offline (issue 42's "online acceptance /
offline agreement").

Offline, the head in float32 is unrolled on the served runner's features of own AR's answers
(train/distill/head.py evaluate). Online, the engine's acceptance of a step's first draft
token. The two count different rows: offline every output row, online only the rows a step
starts from (a request's first output, and those after a rejection or a full chain's bonus
token), which depend on the head's own acceptance. `step_starts` reads those rows off the engine's capture of one more
speculative pass, so the offline figure is also given at exactly the rows drafted online: the
ratio there is what the served head loses to its kernels and features, not to which rows it
was asked.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

NONE = {"offline_agreement_per_depth": None, "online_over_offline_depth1": None, "depth1_same_rows": None}


def step_starts(accepted: Sequence[bool], draft_tokens: Sequence[int]) -> list[tuple[int, bool]]:
    """(output index, accepted) of every step's first draft token, from a capture (one entry
    per output: whether it was an accepted draft, and the token drafted there, -1 where none
    was). A step starts at the first output (the prefill leaves the prompt's last token to the
    first step, which may draft beside it) and after an output that was not an accepted draft
    (a rejection, the target's bonus token); it drafted there when a token was proposed."""
    return [(i, bool(accepted[i])) for i in range(len(accepted))
            if (i == 0 or not accepted[i - 1]) and draft_tokens[i] >= 0]


def drafted_rows(engine: Any, ids_list: Sequence[list[int]], outputs: Sequence[list[int]],
                 max_new_tokens: int) -> list[list[tuple[int, bool]]]:
    """One more greedy speculative pass per prompt, captured, untimed: each prompt's step
    starts (step_starts). A prompt whose output differs from `outputs` (own AR's) gives none,
    since the offline rows are those of own AR's answer."""
    from serve.engine.sequence import GenerationParams

    out = []
    for ids, want in zip(ids_list, outputs):
        r = engine.generate(ids, GenerationParams(max_new_tokens=max_new_tokens, speculate=True, capture=True))
        same = r.capture is not None and list(r.output_ids) == list(want)
        out.append(step_starts(r.capture.accepted.tolist(), r.capture.draft_tokens.tolist()) if same else [])
    return out


def same_rows(flags: Sequence[Any], drafted: Sequence[list[tuple[int, bool]]],
              first: Sequence[int]) -> dict[str, Any] | None:
    """Online and offline depth-1 agreement over the rows drafted online. flags[p]: prompt p's
    offline agreement by row (evaluate's agree_rows), entry j for its output first[p] + j."""
    online = offline = n = 0
    for rows, got, f in zip(flags, drafted, first):
        for i, acc in got:
            if 0 <= i - f < len(rows):
                online += acc
                offline += bool(rows[i - f])
                n += 1
    if not n:
        return None
    return {"rows": n, "online": online / n, "offline": offline / n,
            "online_over_offline": online / offline if offline else None}


def offline_figures(model: Any, runner: Any, draft: Any, ids_list: list[list[int]], outputs: list[list[int]],
                    online: list[float], drafted: dict[str, Sequence[list[tuple[int, bool]]]] | None = None
                    ) -> dict[str, Any]:
    """For a head: its greedy agreement per depth offline on the prompts' own-AR answers, its
    weights in float32 (not the engine's kernels) on the served runner's features, from the
    row that drafts a request's first output (row p - 2 of a p-token prompt: its first step
    feeds the prompt's last token with drafts; a one-token prompt's from its second); the online acceptance
    at depth 1 over it; and, given `drafted` (drafted_rows by method: the run's own head, and the
    same head on PyTorch where the bench ran it), both at depth 1 on the rows each drafted from
    online alone (depth1_same_rows, by method). Depth 1 alone compares like with like: deeper online
    positions count only where the ones before were accepted."""
    head = getattr(draft, "model", draft)  # head+suffix: its head
    if getattr(head, "osd_family", None) != "head":
        return dict(NONE)
    from pipeline.teacher.served_forward import RunnerForward
    from train.distill.head import evaluate
    from train.online.served import feature_set

    seqs = [ids + out for ids, out in zip(ids_list, outputs)]
    starts = [max(len(ids) - 2, 0) for ids in ids_list]
    rows = RunnerForward(model, runner)(seqs, tuple(head.feature_layers), starts)
    fs = feature_set(rows, starts)
    alone = head is draft  # head+suffix: the online figures count the suffix draft's positions too
    by_row = alone and bool(drafted)
    ev = evaluate(copy.deepcopy(head).float(), fs, per_row=by_row)  # evaluate's batches are float32
    offline = ev["agree_per_depth"]
    ratio = online[0] / offline[0] if alone and online and offline and offline[0] else None
    same = None
    if by_row:
        first = [s + 2 - len(ids) for s, ids in zip(starts, ids_list)]  # the output row `start` drafts
        same = {method: same_rows(ev["agree_rows"], rows, first) for method, rows in drafted.items()}
    return {"offline_agreement_per_depth": offline, "online_over_offline_depth1": ratio, "depth1_same_rows": same}
