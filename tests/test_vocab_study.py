"""pipeline/studies/vocab_study.py (`osd draft vocab-study`) and the head warm start's configurable
vocabulary source, on the tiny target's own answers (no real weights)."""

import json

import numpy as np
import pytest
import torch

from infra.config import OSDConfig
from infra.drafts.spec import DraftLoadError, DraftSpec
from infra.prompts import DOMAINS, Prompt
from infra.target import load_target
from pipeline.studies.vocab_study import StudyError, format_table, parse_eval_files, round_robin, run_vocab_study
from train.distill.draft_vocab import coverage, pooled_frequencies, token_counts
from train.teacher.sets import teacher_records

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

WORDS = {"code": "write python code for", "math": "solve the equation", "writing": "write an essay on",
         "other": "tell me about"}


def sharegpt():
    """Made-up ShareGPT prompts: 3 train and 2 held-out per domain."""
    return [Prompt(f"{d}-{s}-{i}", f"{WORDS[d]} thing {i} {s}", d, s)
            for d in DOMAINS for s, n in (("train", 3), ("held_out", 2)) for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-random", progress=False)


def _cfg(tmp_path, **train):
    return OSDConfig.model_validate({"state_dir": str(tmp_path / "state"), "model": {"target": "tiny-random"},
                                     "train": {"warm_max_new_tokens": 6, **train}})


def test_the_study_measures_every_domain_and_writes_json(tmp_path, tiny, capsys):
    from infra.drafts.head import build_head, save_head

    reasoning = tmp_path / "reasoning.jsonl"
    reasoning.write_text('{"prompt": "if a then b; a; so?"}\n{"prompt": "which is heavier?"}\n')
    head = save_head(build_head(tiny.model, DraftSpec(family="head", draft_vocab=40)), tmp_path / "head",
                     target_ref={"spec": "tiny-random"})
    out = run_vocab_study(_cfg(tmp_path), per_domain=3, held_per_domain=2, sizes=(16, 64, 128),
                          eval_files={"reasoning": str(reasoning)}, draft=head, json_path=tmp_path / "v.json",
                          loaded=tiny, sharegpt=sharegpt(), progress=False)
    saved = json.loads((tmp_path / "v.json").read_text())
    assert list(saved["eval"]) == ["chat", "code", "math", "writing", "reasoning"]
    assert list(saved["fit"]) == ["chat", "code", "math", "writing"]
    assert all(f["prompts"] == 3 and f["tokens"] > 0 for f in saved["fit"].values())
    assert all(saved["eval"][d]["prompts"] == 2 for d in saved["eval"])  # 2 held out a domain, 2 lines of file
    cov = out["coverage"]
    for choice in ("balanced", "pooled"):
        for d, by_size in cov[choice].items():
            vals = [by_size[v] for v in (16, 64, 128)]
            assert all(0 <= x <= 1 for x in vals) and vals == sorted(vals), (choice, d)  # more ids cover more
    # The saved head's d2t (ids 0..39 by default) is measured as saved.
    assert set(cov["draft"]["code"]) == {40}
    held = [p for p in sharegpt() if p.split == "held_out"]
    by_id = {r.request_id: r for r in teacher_records(_cfg(tmp_path), tiny, held, progress=False)}
    code = token_counts([by_id[p.id].output_ids for p in sharegpt() if p.id in by_id and p.domain == "code"],
                        tiny.model.config.vocab_size)
    assert cov["draft"]["code"][40] == pytest.approx(coverage(np.arange(40), code))
    printed = capsys.readouterr().out
    assert "reasoning" in printed and "balanced 16384" not in printed and "balanced 16" in printed
    assert format_table(out).splitlines()[0] in printed


def test_the_head_s_own_vocabulary_is_measured_as_saved(tmp_path, tiny):
    from infra.drafts.head import build_head, save_head, saved_draft_vocab

    d2t = torch.tensor([3, 7, 11, 200])
    path = save_head(build_head(tiny.model, DraftSpec(family="head", draft_vocab=4), d2t), tmp_path / "h",
                     target_ref={"spec": "tiny-random"})
    assert saved_draft_vocab(path).tolist() == [3, 7, 11, 200]
    with pytest.raises(DraftLoadError, match="not a draft directory"):
        saved_draft_vocab(tmp_path / "nowhere")


def test_eval_file_names_are_checked():
    assert parse_eval_files(["reasoning=a.jsonl", "web = b.jsonl"]) == {"reasoning": "a.jsonl", "web": "b.jsonl"}
    for bad in (["reasoning"], ["=a.jsonl"], ["x="], ["code=a.jsonl"], ["r=a", "r=b"]):
        with pytest.raises(StudyError):
            parse_eval_files(bad)


def test_prompts_alternate_between_domains_so_a_budget_stop_keeps_them_even():
    a = [Prompt(f"a{i}", "t", "code", "train") for i in range(3)]
    b = [Prompt("b0", "t", "math", "train")]
    assert [p.id for p in round_robin([a, b, [a[0]]])] == ["a0", "b0", "a1", "a2"]


def test_a_study_with_no_fit_prompts_is_refused(tmp_path, tiny):
    held_only = [p for p in sharegpt() if p.split == "held_out"]
    with pytest.raises(StudyError, match="no fit domain"):
        run_vocab_study(_cfg(tmp_path), per_domain=3, held_per_domain=2, sizes=(16,), json_path=None,
                        loaded=tiny, sharegpt=held_only, progress=False)


def test_head_vocab_source_default_is_the_training_data_s_counts(tmp_path, tiny):
    from train.warm.head import draft_vocab_counts

    am = torch.tensor([1, 1, 5, 9, 9, 9])
    got = draft_vocab_counts(_cfg(tmp_path), tiny, am, pool=sharegpt(), progress=False)
    assert torch.equal(got, torch.bincount(am, minlength=tiny.model.config.vocab_size))
    assert not (tmp_path / "state" / "teacher").exists()  # nothing generated for the default


def test_head_vocab_source_teacher_domains_weights_every_domain_alike(tmp_path, tiny):
    from train.warm.head import draft_vocab_counts
    from train.teacher.sets import split_held_out, warm_prompts

    cfg = _cfg(tmp_path, held_out_every=1000)
    am = torch.tensor([1, 1, 5, 9, 9, 9])
    got = draft_vocab_counts(cfg, tiny, am, pool=sharegpt(), progress=False, source="teacher_domains", per_domain=3)
    prompts = [p for d in DOMAINS for p in warm_prompts(cfg, 3, domain=d, prompts=sharegpt())]
    recs, _ = split_held_out(teacher_records(cfg, tiny, prompts, progress=False), 1000)  # cached: read back
    vocab = tiny.model.config.vocab_size
    sources = {"warm_data": np.bincount(am.numpy(), minlength=vocab),
               **{d: token_counts([r.output_ids for r in recs if r.domain == d], vocab) for d in DOMAINS}}
    assert all(sources[d].sum() for d in DOMAINS)  # every domain's answers took part
    assert np.allclose(got.numpy(), pooled_frequencies(sources))
