"""serve/sampling/processors.py: the penalties, logit bias and min_tokens, and returned log-probs.

Pure tensor tests in milliseconds. The engine-level checks (greedy equality with and without
a draft, chi-square with a draft, log-probs with and without speculation) are in
tests/test_engine_processors.py.
"""

import pytest
import torch

from chi2 import chi2_pvalue
from serve.sampling.processors import LogitsProcessor, ProcessorParams, token_logprobs
from serve.sampling.verify import SamplingParams, verify_sampling, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

V = 12
EOS = 11


def proc(params: ProcessorParams, prompt=(1, 2), out=()) -> LogitsProcessor:
    p = LogitsProcessor(params, list(prompt), [EOS], V, torch.device("cpu"))
    p.add(list(out))
    return p


def reference(logits: torch.Tensor, params: ProcessorParams, prompt, out) -> torch.Tensor:
    """The rules written out token by token, as vLLM's docs state them (one row)."""
    x = logits.clone().float()
    for tok, b in params.logit_bias:
        x[tok] += b
    if len(out) < params.min_tokens:
        x[EOS] = float("-inf")
    for tok in set(prompt) | set(out):
        r = params.repetition_penalty
        x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    for tok in set(out):
        x[tok] -= params.frequency_penalty * out.count(tok) + params.presence_penalty
    return x


ALL = ProcessorParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                      logit_bias=((3, 5.0), (4, -100.0)), min_tokens=4)


@pytest.mark.parametrize("params", [
    ProcessorParams(presence_penalty=1.5), ProcessorParams(frequency_penalty=-0.5),
    ProcessorParams(repetition_penalty=1.8), ProcessorParams(repetition_penalty=0.6),
    ProcessorParams(logit_bias=((0, 2.5), (7, -3.0))), ProcessorParams(min_tokens=3), ALL,
])
def test_one_row_follows_the_written_rules(params):
    torch.manual_seed(0)
    logits = torch.randn(V) * 3
    prompt, out = [1, 2, 5], [5, 6, 6, 9]
    got = proc(params, prompt, out).apply(logits.unsqueeze(0), torch.empty(0, dtype=torch.long))[0]
    torch.testing.assert_close(got, reference(logits, params, prompt, out))


def test_repetition_penalty_lowers_positive_and_negative_logits_alike():
    logits = torch.tensor([[2.0, -2.0] + [0.5] * (V - 2)])
    got = proc(ProcessorParams(repetition_penalty=2.0), prompt=[0, 1]).apply(logits, torch.empty(0, dtype=torch.long))
    assert got[0, 0] == 1.0 and got[0, 1] == -4.0 and got[0, 2] == 0.5


def test_each_verify_row_sees_the_drafts_before_it():
    """Row j of a block equals a processor that committed drafts[:j] and processes one row: the
    prefix a position conditions on, exactly as decoding it alone would."""
    torch.manual_seed(1)
    out = [3, 3, 7]
    drafts = torch.tensor([7, 11, 3, 2])
    logits = torch.randn(drafts.numel() + 1, V)
    got = proc(ALL, out=out).apply(logits, drafts)
    for j in range(drafts.numel() + 1):
        alone = proc(ALL, out=out + drafts[:j].tolist()).apply(logits[j:j + 1], torch.empty(0, dtype=torch.long))
        torch.testing.assert_close(got[j], alone[0])


def test_a_draft_row_sees_every_draft_so_far():
    torch.manual_seed(2)
    drafts = torch.tensor([5, 5, 8])
    row = torch.randn(1, V)
    got = proc(ALL, out=[1]).apply(row, drafts)
    want = proc(ALL, out=[1, 5, 5, 8]).apply(row, torch.empty(0, dtype=torch.long))
    torch.testing.assert_close(got, want)


def test_min_tokens_masks_stop_ids_until_enough_tokens_are_out():
    logits = torch.zeros(4, V)
    got = proc(ProcessorParams(min_tokens=3), out=[1]).apply(logits, torch.tensor([2, 3, 4]))
    # Rows see 1, 2, 3, 4 tokens out: EOS held back while fewer than 3.
    assert got[:, EOS].tolist() == [float("-inf"), float("-inf"), 0.0, 0.0]
    assert torch.isfinite(got[:, :EOS]).all()
    none = LogitsProcessor(ProcessorParams(min_tokens=3), [1], [], V, torch.device("cpu"))  # ignore_eos: no stop ids
    assert torch.isfinite(none.apply(logits, torch.tensor([2, 3, 4]))).all()


def test_reduced_vocab_columns_equal_the_full_vocab_picked():
    torch.manual_seed(3)
    columns = torch.tensor([0, 3, 4, 5, 11])  # a head draft's d2t: draft column -> target id
    full = torch.randn(3, V)
    drafts = torch.tensor([3, 5])
    p = proc(ALL, out=[5, 0])
    torch.testing.assert_close(p.apply(full[:, columns], drafts, columns), p.apply(full, drafts)[:, columns])


def test_apply_leaves_the_raw_logits_untouched():
    logits = torch.randn(2, V)
    before = logits.clone()
    proc(ALL, out=[1, 3]).apply(logits, torch.tensor([4]))
    assert torch.equal(logits, before)


def test_neutral_params_are_inactive_and_bad_ones_refused():
    assert not ProcessorParams().active and ALL.active
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0.0),
                dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)), dict(min_tokens=-1)):
        with pytest.raises(ValueError):
            ProcessorParams(**bad)


def test_too_few_drafts_for_the_rows_is_an_error():
    with pytest.raises(ValueError):
        proc(ALL).apply(torch.zeros(3, V), torch.tensor([1]))


def test_token_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(4)
    logits = torch.randn(3, V) * 2
    got = token_logprobs(logits, [4, 0, 9], 3)
    lp = torch.log_softmax(logits, -1)
    for i, (tok, (chosen, top)) in enumerate(zip([4, 0, 9], got)):
        assert chosen == pytest.approx(float(lp[i, tok]), abs=1e-6)
        assert [t for t, _ in top] == torch.topk(lp[i], 3).indices.tolist()
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert [top for _, top in token_logprobs(logits, [4, 0], 0)] == [[], []]
    assert token_logprobs(logits, [], 2) == []


_TABLES = {scale: torch.randn(V, V, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
           for scale in (1.0, 2.0)}


def _model(prefix: tuple[int, ...], scale: float) -> torch.Tensor:
    """A fixed 'language model' over V tokens whose logits depend on the last token (scale 2.0
    the target, 1.0 the draft)."""
    return _TABLES[scale][prefix[-1]]


def test_speculative_sampling_with_processors_on_p_and_q_follows_the_processed_target():
    """Two positions drafted at once from q (another model) with the processors applied to both,
    verified by rejection against p: the first two tokens follow the processed target exactly."""
    params = ProcessorParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5,
                             logit_bias=((2, 2.0), (6, -100.0)), min_tokens=2)
    sp = SamplingParams(temperature=0.9)
    prompt, none = (1, 2), torch.empty(0, dtype=torch.long)
    exact = torch.zeros(V, V)
    p1 = warp_probs(proc(params, prompt).apply(_model(prompt, 2.0).unsqueeze(0), none)[0], sp)
    for a in range(V):
        p2 = warp_probs(proc(params, prompt, [a]).apply(_model(prompt + (a,), 2.0).unsqueeze(0), none)[0], sp)
        exact[a] = p1[a] * p2
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    rejected = 0
    for _ in range(3000):
        pr = proc(params, prompt)
        drafts, qs = [], []
        for i in range(2):
            ctx = prompt + tuple(drafts)
            q = warp_probs(pr.apply(_model(ctx, 1.0).unsqueeze(0), torch.tensor(drafts, dtype=torch.long))[0], sp)
            drafts.append(int(torch.multinomial(q, 1, generator=gen)))
            qs.append(q)
        d = torch.tensor(drafts)
        target = torch.stack([_model(prompt + tuple(drafts[:j]), 2.0) for j in range(3)])
        p = warp_probs(pr.apply(target, d), sp)
        n, nxt = verify_sampling(d, torch.stack(qs), p, gen)
        out = (drafts[:n] + [nxt])
        if n == 0:
            rejected += 1
            pr.add(out)  # the second token comes from the next step, with the first committed
            row = pr.apply(_model(prompt + (out[0],), 2.0).unsqueeze(0), none)[0]
            out.append(int(torch.multinomial(warp_probs(row, sp), 1, generator=gen)))
        counts[out[0], out[1]] += 1
    assert rejected > 200
    assert counts[:, EOS].sum() == 0 and counts[EOS].sum() == 0  # min_tokens=2
    assert chi2_pvalue(counts, exact) > 1e-3
