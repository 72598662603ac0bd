"""The online head trainer's features in the served weight format (train/online/served.py,
pipeline/teacher/served_forward.py): for an int4 target on the native forward, the features it
trains, estimates α and gates on are, bit for bit, those the serving engine fed the head; the
float32 training copy's are not; the float32 path stays where serving is not int4 or its
runner cannot be built."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infra.config import OSDConfig
from infra.drafts.head import build_head
from infra.drafts.spec import DraftSpec
from infra.records.schema import Record
from infra.target import LoadedModel, load_target, tiny_tokenizer
from pipeline.teacher.engine import EngineTeacher
from pipeline.teacher.served_forward import served_forward
from serve.engine.core import SpecEngine
from serve.engine.sequence import GenerationParams
from serve.model import native_build
from serve.spec_decode.head.draft import HeadRunner
from engine_options import small_options
from train.distill.ds_engine import autocast_context
from train.distill.head import per_record_acceptance_head
from train.online.family import HeadFamily, per_record
from train.online.served import served_features

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native_build.supported(), reason="this CPU runs no native variant")]

LAYERS = (0, 1)  # of tiny-random's two layers
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41], [100, 3, 100, 3, 100, 7]]
NEW, K = 24, 8


def _cfg(**model) -> OSDConfig:
    return OSDConfig.model_validate({"model": {"target": "tiny-random", **model}})


INT4 = dict(quant="int4", dtype="bfloat16", cpu_kernels="native")


@pytest.fixture(scope="module")
def served():
    forward, why = served_forward(_cfg(**INT4))
    assert forward is not None, why
    return forward


@pytest.fixture(scope="module")
def f32():
    """The target as a trainer loads it: the same weights in float32, unquantized."""
    return load_target("tiny-random", _cfg(**INT4).model.for_training(), progress=False).model


def _head(model):
    return build_head(model, DraftSpec(family="head", feature_layers=LAYERS, draft_vocab=200))


def _record(prompt, result, i) -> Record:
    c = result.capture
    return Record(request_id=f"r{i}", draft_version="x", prompt_ids=np.asarray(prompt, np.int32),
                  output_ids=np.asarray(result.output_ids, np.int32), topk_ids=c.topk_ids,
                  topk_logprobs=c.topk_logprobs, accepted=c.accepted, draft_tokens=c.draft_tokens,
                  draft_probs=c.draft_probs)


@pytest.fixture(scope="module")
def serving(served):
    """Greedy requests served by the int4 target with a speculating head (verify blocks of
    several rows beside one-row decodes and prompt chunks): their records, and the feature rows
    the engine handed the head while it generated each."""
    fed: list[torch.Tensor] = []
    mp = pytest.MonkeyPatch()
    prefilled, commit = HeadRunner.prefilled, HeadRunner.commit

    def on_prefill(self, seq, feats):
        fed.append(feats.clone())
        prefilled(self, seq, feats)

    def on_commit(self, seq, base, n, drafted, feats):
        fed.append(feats.clone())
        commit(self, seq, base, n, drafted, feats)

    mp.setattr(HeadRunner, "prefilled", on_prefill)
    mp.setattr(HeadRunner, "commit", on_commit)
    eng = SpecEngine(served.model, _head(served.model),
                     options=small_options(k=3, k_policy="fixed", max_seq_len=128, quant="int4", cpu_kernels="native",
                                           capture_top_k=K, prefill_chunk=4))
    records, rows = [], []
    try:
        for i, prompt in enumerate(PROMPTS):
            fed.clear()
            r = eng.generate(prompt, GenerationParams(max_new_tokens=NEW))
            assert r.stats.num_draft_tokens > 0  # verify blocks of several rows were served
            records.append(_record(prompt, r, i))
            rows.append(torch.cat(fed)[:len(prompt) + len(r.output_ids) - 1])  # rows past the last token: none
    finally:
        mp.undo()
    return records, rows


def test_the_head_trainer_features_are_those_the_engine_fed_the_head(served, f32, serving):
    records, fed = serving
    fam = HeadFamily(f32, _train(), _head(f32), served)
    fs = fam.features(records)
    for rec, rows, ids, feats, argmax in zip(records, fed, fs.ids, fs.feats, fs.argmax):
        tokens = rec.prompt_ids.tolist() + rec.output_ids.tolist()
        assert ids.tolist() == tokens[:-1]
        assert torch.equal(feats, rows)
        assert argmax[len(rec.prompt_ids) - 1:].tolist() == rec.output_ids.tolist()  # greedy: what it emitted


def test_the_float32_copy_computes_other_features_than_were_served(served, f32, serving):
    """What the trainer did before: the same records through the float32 copy."""
    records, fed = serving
    fs = HeadFamily(f32, _train(), _head(f32)).features(records)
    assert not any(torch.equal(feats[:-1], rows) for feats, rows in zip(fs.feats, fed))


def test_served_rows_equal_the_serving_capture_and_a_one_row_decode(served):
    """Against the teacher's serve-time capture (pipeline/teacher/feature_recorder.py) and a
    decode of the served runner one token at a time: features, final hidden and argmax."""
    loaded = LoadedModel(served.model, tiny_tokenizer(), "tiny-random", None, 0.0)
    cfg = OSDConfig.model_validate({"model": {"target": "tiny-random", **INT4}, "serve": {"prefill_chunk": 4},
                                    "train": {"warm_batch_size": 2}})
    captured = EngineTeacher(cfg, loaded).capture(PROMPTS, NEW, K, None, LAYERS)
    r = served.runner
    h = served.model.config.hidden_size
    for prompt, ((out, _, _), cap) in zip(PROMPTS, captured):
        tokens = prompt + out.tolist()
        mine = served([tokens], LAYERS)[0]
        assert torch.equal(mine.ids, cap.ids) and torch.equal(mine.feats, cap.feats)
        assert torch.equal(mine.final, cap.final)
        assert torch.equal(mine.argmax[len(prompt) - 1:], cap.argmax[len(prompt) - 1:])
        cache = r.new_cache()
        for t, tok in enumerate(tokens[:-1]):
            logits, f = r.forward_features(torch.tensor([tok]), cache, LAYERS)
            assert torch.equal(mine.feats[t], f[0])
            final = F.rms_norm(f[0, -h:], (h,), served.model.model.norm.weight, served.model.config.rms_norm_eps)
            assert torch.equal(mine.final[t], final) and int(mine.argmax[t]) == int(logits.argmax())


def test_a_one_token_sequence_has_no_row(served):
    rows = served([[5]], LAYERS)[0]
    h = served.model.config.hidden_size
    assert rows.ids.numel() == 0 and rows.feats.shape == (0, len(LAYERS) * h) and rows.final.shape == (0, h)


def _train(**kw):
    from infra.config import load_config

    return load_config(environ={}, overrides={"train": kw}).train


class _Counting:
    def __init__(self, forward):
        self.forward, self.sequences = forward, 0

    def __call__(self, seqs, layers, logits_from=None):
        self.sequences += len(seqs)
        return self.forward(seqs, layers, logits_from)


def test_each_record_is_run_once_while_kept_and_the_gate_scores_served_features(served, f32, serving):
    records, _ = serving
    counting = _Counting(served)
    head = _head(f32)
    fam = HeadFamily(f32, _train(), head, counting)
    fam.batch(records)
    fam.score(head, records)
    got = fam.score(head, records)
    assert counting.sequences == len(records)  # FEATURES_KEPT: steps and every look of the gate reuse them
    feats = served_features(served, records, LAYERS, fam.tc.max_seq_len)
    with autocast_context(fam.autocast, "cpu"):  # the family scores its own head under its autocast rule
        want = per_record_acceptance_head(head, f32, records, fam.tc.max_seq_len, features=feats)
    assert got == want
    other = build_head(f32, DraftSpec(family="head", feature_layers=(1,), draft_vocab=200))
    assert fam.score(other, records) == per_record(other, f32, records, fam.tc.max_seq_len, forward=served)
    assert counting.sequences == 2 * len(records)  # a head of other layers: through the served forward too


@pytest.mark.parametrize("logits_from", [0, 1, 5, 16, 17, 40])
def test_rows_without_their_greedy_token_have_the_same_features(served, serving, logits_from):
    """Rows before `logits_from` skip the LM head (a prefill), in the same block or an earlier one
    (blocks of 16 rows here): their features and final hidden are the same bits, the greedy
    tokens from `logits_from` on too, and -1 before it."""
    records, _ = serving
    block, served.block = served.block, 16  # the native forward's are 256 rows: several blocks here
    try:
        tokens = [rec.prompt_ids.tolist() + rec.output_ids.tolist() for rec in records]
        full = served(tokens, LAYERS)
        part = served(tokens, LAYERS, [logits_from] * len(tokens))
    finally:
        served.block = block
    for a, b in zip(full, part):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.feats, b.feats) and torch.equal(a.final, b.final)
        assert torch.equal(a.argmax[logits_from:], b.argmax[logits_from:])
        assert bool((b.argmax[:logits_from] == -1).all())


def test_the_features_carry_the_greedy_tokens_their_use_reads(served, f32, serving):
    """Scores read the records' own top-k: no greedy token; a step on output rows reads them from
    each record's start on; a record scored first and then trained on is run again for them, one
    trained on first is not run again for its scores; and the step's loss is the same bits as on
    features with every row's greedy token."""
    from train.distill.head import collate
    from train.online.served import GREEDY_ROWS

    records, _ = serving
    counting = _Counting(served)
    head = _head(f32)
    fam = HeadFamily(f32, _train(head_loss_rows="outputs"), head, counting)
    scored = fam.features(records[:1], "none")
    assert bool((scored.argmax[0] == -1).all()) and counting.sequences == 1
    fam.score(head, records[1:])
    assert counting.sequences == len(records)
    batch = fam.batch(records)  # every record again: kept with no greedy token
    assert counting.sequences == 2 * len(records)
    fam.score(head, records)
    assert counting.sequences == 2 * len(records)
    fs = fam.features(records, "outputs")
    for argmax, start in zip(fs.argmax, fs.start):
        assert bool((argmax[:start] == -1).all()) and bool((argmax[start:] >= 0).all())
    whole = served_features(served, records, LAYERS, fam.tc.max_seq_len)
    loss = fam.loss_fn()
    out_of_vocab = int((~head.t2d()).nonzero()[0])

    def step_loss(fs, upto=None, token=out_of_vocab):  # greedy tokens [0, start + upto) replaced
        fs = copy.deepcopy(fs)
        if upto is not None:
            for argmax, start in zip(fs.argmax, fs.start):
                argmax[:start + upto] = token
        with torch.no_grad(), autocast_context(fam.autocast, "cpu"):
            return loss(head, collate(fs, range(len(fs))))

    assert torch.equal(step_loss(fs), step_loss(whole))
    for token in (out_of_vocab, int(head.d2t[0])):  # what the skipped rows hold does not matter
        assert torch.equal(step_loss(whole, 1, token), step_loss(whole))
    assert not torch.equal(step_loss(whole, 2), step_loss(whole))  # the row at start + 1 is read
    for bad in (lambda: served_features(served, records, LAYERS, 1024, greedy="some"),
                lambda: fam.features(records, "outputs only")):
        with pytest.raises(ValueError, match="greedy must be one of"):
            bad()
    with pytest.raises(ValueError, match="logits_from has 2 rows for 1 sequences"):
        served([[5, 6, 7]], LAYERS, [0, 0])
    assert GREEDY_ROWS == ("none", "outputs", "all")


def test_rows_of_other_tokens_are_refused(served, serving):
    records, _ = serving

    def shifted(seqs, layers, logits_from=None):
        return served([s[1:] for s in seqs], layers)

    with pytest.raises(ValueError, match="not those of the records' tokens"):
        served_features(shifted, records, LAYERS, 1024)


@pytest.mark.parametrize("model, why", [(dict(quant="none", dtype="float32"), "served in float32, unquantized"),
                                        (dict(quant="none", dtype="bfloat16"), "served in bfloat16, unquantized")])
def test_a_target_served_unquantized_keeps_the_float32_copy(model, why):
    forward, line = served_forward(_cfg(**model))
    assert forward is None and "float32 training copy" in line and why in line


def test_a_native_runner_that_cannot_load_falls_back_and_says_why(monkeypatch):
    def unavailable():
        raise native_build.NativeUnavailable("no compiler here")

    monkeypatch.setattr(native_build, "load", unavailable)
    monkeypatch.setattr("serve.model.native_runner.load", unavailable)
    forward, line = served_forward(_cfg(**INT4))
    assert forward is None and "cannot be built" in line and "no compiler here" in line
    forward, line = served_forward(_cfg(**{**INT4, "cpu_kernels": "auto"}))  # auto: PyTorch's int4 kernels serve
    assert forward is not None and forward.kernels == "PyTorch's int4 kernels" and "PyTorch's int4" in line


def test_pytorch_int4_kernels_give_a_one_row_decode_s_features(served):
    """The torch runner's blocks of ROW_EXACT_MAX_T rows compute each row as its decode does."""
    forward, _ = served_forward(_cfg(**{**INT4, "cpu_kernels": "torch"}))
    tokens = list(range(3, 43))  # several blocks
    rows = forward([tokens], LAYERS)[0]
    cache = forward.runner.new_cache()
    for t, tok in enumerate(tokens[:-1]):
        logits, f = forward.runner.forward_features(torch.tensor([tok]), cache, LAYERS)
        assert torch.equal(rows.feats[t], f[0]) and int(rows.argmax[t]) == int(logits.argmax())
    assert not torch.equal(rows.feats, served([tokens], LAYERS)[0].feats)  # not the native forward's bits


def test_a_trainer_given_no_served_forward_or_training_a_layer_draft_uses_the_float32_copy(tmp_path, capsys, f32):
    from infra.drafts.layer import build_draft
    from train.online.trainer import TrainerWorker

    asked = []

    def factory(cfg):
        asked.append(cfg)
        return "a forward", "the line"

    cfg = _cfg(**INT4).model_dump(mode="json")
    assert TrainerWorker(cfg, 0, 1, str(tmp_path))._served_forward(_head(f32)) is None
    assert "given no served forward" in capsys.readouterr().out
    layer = build_draft(f32, DraftSpec(num_layers=1))
    assert TrainerWorker(cfg, 0, 1, str(tmp_path), served=factory)._served_forward(layer) is None and not asked
    assert TrainerWorker(cfg, 0, 1, str(tmp_path), served=factory)._served_forward(_head(f32)) == "a forward"
    assert "the line" in capsys.readouterr().out and len(asked) == 1


def test_the_engine_bench_scores_a_head_offline_on_the_served_features(served, serving):
    """`osd bench engine`'s offline figure for a head (pipeline/bench/online_offline.py offline_figures):
    its greedy agreement per depth on the prompts' answers from the row that drafts a request's
    second output, on the served runner's features; the ratio to the online depth-1 acceptance
    only for a head alone (head+suffix counts the suffix draft's positions online)."""
    from pipeline.bench.online_offline import offline_figures
    from train.distill.head import evaluate
    from train.online.served import feature_set

    records, _ = serving
    head = _head(served.model)
    ids = [r.prompt_ids.tolist() for r in records]
    outs = [r.output_ids.tolist() for r in records]
    got = offline_figures(served.model, served.runner, head, ids, outs, [0.25, 0.1, 0.0])
    starts = [len(p) - 2 for p in ids]  # the rows drafting each first output (PROMPTS: two tokens or more)
    def agreement(starts):
        fs = feature_set(served([p + o for p, o in zip(ids, outs)], LAYERS, starts), starts)
        return evaluate(copy.deepcopy(head).float(), fs)["agree_per_depth"]

    want = agreement(starts)
    assert got["offline_agreement_per_depth"] == pytest.approx(want) and len(want) == 3
    assert got["online_over_offline_depth1"] == pytest.approx(0.25 / want[0])
    # from the row drafting the first output, which a request's first step drafts online
    assert agreement([s + 1 for s in starts]) != pytest.approx(want)

    class WithHead:  # head+suffix's shape: the head as .model
        model = head

    hybrid = offline_figures(served.model, served.runner, WithHead(), ids, outs, [0.25])
    assert hybrid["offline_agreement_per_depth"] == pytest.approx(want) and hybrid["online_over_offline_depth1"] is None
    assert offline_figures(served.model, served.runner, object(), ids, outs, [0.25]) == {
        "offline_agreement_per_depth": None, "online_over_offline_depth1": None, "depth1_same_rows": None}
    assert got["depth1_same_rows"] is None and hybrid["depth1_same_rows"] is None  # no online rows given


def test_step_starts_are_the_outputs_after_one_that_was_not_an_accepted_draft():
    from pipeline.bench.online_offline import step_starts

    # outputs: the first step drafted nothing (0); a step of 3 drafts, 2 kept (reject at 3); a step
    # all kept + bonus (4, 5 accepted, 6 the bonus); a step that drafted nothing (7); a step whose
    # first draft fails (8)
    accepted = [False, True, True, False, True, True, False, False, False]
    drafts = [-1, 11, 12, 99, 14, 15, -1, -1, 98]
    assert step_starts(accepted, drafts) == [(1, True), (4, True), (8, False)]
    assert step_starts([True, False], [5, -1]) == [(0, True)]  # the first step drafts beside the prompt's last token
    assert step_starts([False], [-1]) == [] and step_starts([], []) == []


def agreement_rows(head, fs):
    from train.distill.head import evaluate

    return evaluate(head, fs, depth=1, per_row=True)["agree_rows"]


def test_agreement_rows_are_evaluates_depth_one_row_by_row(served, serving):
    from train.distill.head import evaluate
    from train.online.served import feature_set

    records, _ = serving
    ids = [r.prompt_ids.tolist() for r in records]
    outs = [r.output_ids.tolist() for r in records]
    starts = [len(p) - 2 for p in ids]
    fs = feature_set(served([p + o for p, o in zip(ids, outs)], LAYERS, starts), starts)
    head = copy.deepcopy(_head(served.model)).float()
    flags = agreement_rows(head, fs)
    assert [len(f) for f in flags] == [len(o) for o in outs]  # a row per output
    assert float(torch.cat(flags).float().mean()) == pytest.approx(evaluate(head, fs)["agree_per_depth"][0])
    ev = evaluate(head, fs, per_row=True)  # the rows ride along a full evaluation, changing none of its figures
    assert ev["agree_per_depth"] == evaluate(head, fs)["agree_per_depth"]
    assert all(torch.equal(a, b) for a, b in zip(ev["agree_rows"], flags)) and "agree_rows" not in evaluate(head, fs)
    for p, o, f in zip(ids, outs, flags):  # row by row: alone, each row's flag is its own
        start = [len(p) - 2]
        assert torch.equal(agreement_rows(head, feature_set(served([p + o], LAYERS, start), start))[0], f)
        for j in (0, len(o) // 2, len(o) - 1):  # the sequence cut after output j: its last row drafts it
            cut = feature_set(served([p + o[: j + 1]], LAYERS, start), start)
            assert bool(agreement_rows(head, cut)[0][-1]) == bool(f[j]), j


def test_the_engine_bench_compares_a_head_online_and_offline_on_the_rows_it_drafted(served, serving):
    """drafted_rows reads, from a captured speculative pass, the rows every step drafted its
    first token from and whether it was kept: as many as the engine's depth-1 counts; the
    offline figure over every row is evaluate's, over the drafted rows their own mean."""
    from pipeline.bench.online_offline import drafted_rows, offline_figures, same_rows
    from train.online.served import feature_set

    records, _ = serving
    ids = [r.prompt_ids.tolist() for r in records]
    outs = [r.output_ids.tolist() for r in records]
    head = _head(served.model)
    eng = SpecEngine(served.model, head, options=small_options(k=3, k_policy="fixed", max_seq_len=128, quant="int4",
                                                               cpu_kernels="native", capture_top_k=K))
    drafted = drafted_rows(eng, ids, outs, NEW)
    for p, o, rows in zip(ids, outs, drafted):
        st = eng.generate(p, GenerationParams(max_new_tokens=NEW, speculate=True)).stats
        assert len(rows) == st.drafted_per_pos[0] > 0
        assert sum(acc for _, acc in rows) == st.accepted_per_pos[0]
    assert drafted_rows(eng, ids, [o[:-1] + [o[-1] + 1] for o in outs], NEW) == [[]] * len(ids)  # not own AR's
    got = offline_figures(served.model, served.runner, head, ids, outs, [0.3], {"sd": drafted})
    starts = [len(p) - 2 for p in ids]
    flags = agreement_rows(copy.deepcopy(head).float(),
                           feature_set(served([p + o for p, o in zip(ids, outs)], LAYERS, starts), starts))
    want = [(bool(f[i]), acc) for f, rows in zip(flags, drafted) for i, acc in rows]
    same = got["depth1_same_rows"]["sd"]
    assert same["rows"] == len(want)
    assert same["offline"] == pytest.approx(sum(a for a, _ in want) / len(want))
    assert same["online"] == pytest.approx(sum(b for _, b in want) / len(want))
    every = [[(i, False) for i in range(len(o))] for o in outs]  # every row: evaluate's depth 1
    zero = [0] * len(ids)
    assert same_rows(flags, every, zero)["offline"] == pytest.approx(got["offline_agreement_per_depth"][0])
    assert same_rows(flags, [[]] * len(ids), zero) is None
