"""`osd draft vocab-study`: how much of the target's own output a draft vocabulary of V_d ids
covers, per domain. A position whose target token is outside the draft vocabulary can never
be accepted, so coverage bounds the head's acceptance (issue 29: 0.81-0.85 outside ShareGPT
for today's 8k vocabulary, against 0.93 on ShareGPT).

1. Prompts: train-split ShareGPT prompts of each domain (chat is ShareGPT's "other") choose
   the vocabularies; held-out prompts of each domain, plus any `--eval-file NAME=PATH` JSONL
   (prompts from elsewhere: evaluated only), measure them.
2. Answers: the target's greedy answers through the warm start's teacher cache
   (train/teacher/store.py), so the study and `osd draft init` reuse each other's answers.
   Prompts are taken round-robin across domains, so a budget stop keeps the domains even.
3. Vocabularies (train/distill/draft_vocab.py): "balanced", every domain's frequencies weighted
   alike; "pooled", all fit tokens as one corpus; and the saved head's own d2t when there is
   one. Coverage per domain and V_d: a table on stdout and JSON under reports/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tabulate import tabulate

from infra.config import OSDConfig
from train.distill.draft_vocab import STUDY_SIZES, coverage, coverage_table, token_counts

# Study domain -> ShareGPT's domain tag (infra/prompts.py DOMAINS).
SHAREGPT_DOMAINS = {"chat": "other", "code": "code", "math": "math", "writing": "writing"}


class StudyError(ValueError):
    """The study cannot run on these inputs (named in the message)."""


def parse_eval_files(items: Sequence[str]) -> dict[str, str]:
    """["reasoning=path.jsonl", ...] -> {"reasoning": "path.jsonl"}; names must be new and unique."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise StudyError(f"--eval-file takes NAME=PATH, got {item!r}")
        if name in out or name in SHAREGPT_DOMAINS:
            raise StudyError(f"--eval-file name {name!r} is used twice (ShareGPT's are {', '.join(SHAREGPT_DOMAINS)})")
        out[name.strip()] = path.strip()
    return out


def study_prompts(cfg: OSDConfig, per_domain: int, held_per_domain: int, eval_files: dict[str, str],
                  sharegpt: list | None = None) -> tuple[dict[str, list], dict[str, list]]:
    """({domain: fit prompts}, {domain: eval prompts}). sharegpt: prompts already loaded (tests)."""
    from infra.prompts import load_jsonl, load_sharegpt
    from train.teacher.sets import warm_prompts

    if per_domain < 1 or held_per_domain < 1:
        raise StudyError(f"need >= 1 prompt per domain, got {per_domain} fit and {held_per_domain} held out")
    pool = load_sharegpt(cfg.data) if sharegpt is None else sharegpt
    fit = {name: warm_prompts(cfg, per_domain, domain=d, prompts=pool) for name, d in SHAREGPT_DOMAINS.items()}
    ev = {name: warm_prompts(cfg, held_per_domain, split="held_out", domain=d, prompts=pool)
          for name, d in SHAREGPT_DOMAINS.items()}
    for name, path in eval_files.items():
        ev[name] = load_jsonl(path, cfg.data)
    return fit, ev


def round_robin(groups: Sequence[list]) -> list:
    """One from each group in turn, each prompt once (by id and text)."""
    out, seen = [], set()
    for i in range(max((len(g) for g in groups), default=0)):
        for g in groups:
            if i < len(g) and (g[i].id, g[i].text) not in seen:
                seen.add((g[i].id, g[i].text))
                out.append(g[i])
    return out


def domain_counts(groups: dict[str, list], by_id: dict[str, Any], vocab: int) -> dict[str, np.ndarray]:
    """{domain: [vocab] counts of the answer tokens of its prompts that have an answer}."""
    return {d: token_counts([by_id[p.id].output_ids for p in ps if p.id in by_id], vocab) for d, ps in groups.items()}


def study_table(fit: dict[str, np.ndarray], ev: dict[str, np.ndarray], sizes: Sequence[int],
                draft_vocab: np.ndarray | None) -> dict[str, dict[str, dict[int, float | None]]]:
    """coverage_table over the fit domains that have tokens, plus the saved head's own vocabulary."""
    usable = {d: c for d, c in fit.items() if c.sum()}
    if not usable:
        raise StudyError("no fit domain has any answer tokens (a budget too short, or no prompts)")
    table = coverage_table(usable, ev, sizes)
    if draft_vocab is not None:
        table["draft"] = {d: {int(draft_vocab.size): coverage(draft_vocab, c)} for d, c in ev.items()}
    return table


def run_vocab_study(cfg: OSDConfig, *, per_domain: int = 64, held_per_domain: int = 32,
                    eval_files: dict[str, str] | None = None, sizes: Sequence[int] = STUDY_SIZES,
                    draft: str | Path | None = None, budget_s: float | None = None,
                    json_path: str | Path | None = "reports/vocab/study.json", loaded: Any = None,
                    generate: Any = None, sharegpt: list | None = None, progress: bool = True) -> dict[str, Any]:
    """The study (module doc). loaded / generate / sharegpt: a tiny target, a generator and
    prompts in tests; default the config's target, train.warm_teacher and ShareGPT."""
    from infra.drafts.head import saved_draft_vocab
    from infra.target import load_target
    from train.teacher.sets import teacher_records

    fit_p, ev_p = study_prompts(cfg, per_domain, held_per_domain, eval_files or {}, sharegpt)
    if loaded is None:
        from pipeline.teacher.engine import teacher_for

        loaded = load_target(cfg.model.target, cfg.model.for_training(), progress=progress)
        generate = teacher_for(cfg)
    records = teacher_records(cfg, loaded, round_robin([*fit_p.values(), *ev_p.values()]), progress=progress,
                              generate=generate, budget_s=budget_s)
    by_id = {r.request_id: r for r in records}
    vocab = loaded.model.config.vocab_size
    fit, ev = domain_counts(fit_p, by_id, vocab), domain_counts(ev_p, by_id, vocab)
    d2t = saved_draft_vocab(draft).numpy() if draft else None
    def answered(ps: list) -> int:
        return sum(p.id in by_id for p in ps)

    out = {"sizes": [int(v) for v in sizes], "max_new_tokens": cfg.train.warm_max_new_tokens,
           "generator": generate.tag if generate is not None else "hf", "draft": str(draft) if draft else None,
           "fit": {d: {"prompts": answered(fit_p[d]), "tokens": int(c.sum())} for d, c in fit.items()},
           "eval": {d: {"prompts": answered(ev_p[d]), "tokens": int(c.sum()),
                        "source": (eval_files or {}).get(d, "sharegpt held_out")} for d, c in ev.items()},
           "coverage": study_table(fit, ev, sizes, d2t)}
    print(format_table(out))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2))
    return out


def format_table(study: dict[str, Any]) -> str:
    """Rows: eval domains; columns: each vocabulary choice at each V_d."""
    cov = study["coverage"]
    cols = [(choice, v) for choice, by_domain in cov.items() for v in next(iter(by_domain.values()), {})]
    fit_tokens = sum(f["tokens"] for f in study["fit"].values())
    title = (f"coverage of the target's own answer tokens by draft vocabulary (chosen from {fit_tokens} answer "
             f"tokens of {', '.join(study['fit'])})")
    rows = [[d, e["tokens"], *("-" if cov[c][d][v] is None else f"{cov[c][d][v]:.3f}" for c, v in cols)]
            for d, e in study["eval"].items()]
    table = tabulate(rows, headers=["domain", "tokens", *(f"{c} {v}" for c, v in cols)], disable_numparse=True,
                     colalign=("left",) + ("right",) * (len(cols) + 1))
    return title + "\n" + table
