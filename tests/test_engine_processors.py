"""Penalties, logit bias, min_tokens, ignore_eos and log-probs through the engine (issue 30).

The reference is the processed target decoded by full forwards, one token at a time
(`processed_greedy`, `exact_first_two`): speculation (chains, batches, the device stages, a
head draft, a tree engine) must give its greedy output exactly and its sampled output in
distribution (chi-square), and return the raw target's log-probs whatever the processors.
"""

import pytest
import torch

from chi2 import chi2_pvalue
from infra.target import build_tiny_llama
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, RequestError, SpecEngine
from engine_options import small_options
from serve.sampling.processors import LogitsProcessor, ProcessorParams
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

PENALTIES = ProcessorParams(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
                            logit_bias=((5, 3.0), (17, -100.0), (200, 1.5)))
PROMPTS = [[17, 200, 3, 99, 45], [42], [5, 5, 5, 9, 9]]
N_NEW = 20
NONE = torch.empty(0, dtype=torch.long)


def tiny(seed: int = 0, layers: int = 2, eos: bool = False, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=kw.pop("max_positions", 128), **kw)
    if not eos:
        m.config.eos_token_id = None
    return m


def last_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def processed_row(model, prompt, out, params: ProcessorParams, stop=()) -> torch.Tensor:
    p = LogitsProcessor(params, prompt, stop, model.config.vocab_size, torch.device("cpu"))
    p.add(out)
    return p.apply(last_logits(model, prompt + out).unsqueeze(0), NONE)[0]


def processed_greedy(model, prompt, n, params: ProcessorParams, stop=()) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(processed_row(model, prompt, out, params, stop))))
    return out


@pytest.fixture(scope="module")
def target():
    return tiny(0, layers=4)


@pytest.fixture(scope="module")
def drafts(target):
    return {"bad": tiny(100, layers=1), "perfect": target, "truncated": build_draft("truncate:2", target)}


def engine(target, draft=None, **kw) -> SpecEngine:
    opts = dict(k=3, max_seq_len=128, k_policy="fixed")
    return SpecEngine(target, draft, options=small_options(**{**opts, **kw}))


@pytest.mark.parametrize("draft_kind", [None, "bad", "perfect", "truncated"])
def test_greedy_under_processors_equals_the_processed_target(target, drafts, draft_kind):
    eng = engine(target, drafts[draft_kind] if draft_kind else None)
    gp = GenerationParams(max_new_tokens=N_NEW, processors=PENALTIES)
    for prompt in PROMPTS:
        r = eng.generate(prompt, gp)
        assert r.output_ids == processed_greedy(target, prompt, N_NEW, PENALTIES)
    plain = eng.generate(PROMPTS[0], GenerationParams(max_new_tokens=N_NEW)).output_ids
    assert plain != eng.generate(PROMPTS[0], gp).output_ids  # the penalties changed something
    if draft_kind == "perfect":
        assert r.stats.acceptance_rate == 1.0  # q processed as p is: a perfect draft stays perfect


def test_processors_in_a_batch_equal_each_request_alone(target, drafts):
    eng = engine(target, drafts["truncated"], max_concurrency=3)
    params = [GenerationParams(max_new_tokens=N_NEW, processors=PENALTIES),
              GenerationParams(max_new_tokens=N_NEW),
              GenerationParams(max_new_tokens=N_NEW, processors=ProcessorParams(repetition_penalty=2.0))]
    alone = [eng.generate(p, gp).output_ids for p, gp in zip(PROMPTS, params)]
    streams = [eng.stream(p, gp) for p, gp in zip(PROMPTS, params)]

    async def run_all():
        import asyncio

        async def one(s):
            async for _ in s:
                pass
            return s.result.output_ids

        return await asyncio.gather(*(one(s) for s in streams))

    import asyncio
    assert asyncio.run(run_all()) == alone
    assert eng.scheduler.log.totals()["sequences"] > eng.scheduler.log.totals()["forwards"]  # they did batch


def test_device_stages_and_head_drafts_apply_the_processors(target):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 3)), torch.arange(220))
    want = processed_greedy(target, PROMPTS[0], N_NEW, PENALTIES)
    gp = GenerationParams(max_new_tokens=N_NEW, processors=PENALTIES)
    for draft in (build_draft("truncate:2", target), head):
        assert engine(target, draft).generate(PROMPTS[0], gp).output_ids == want
        dev = engine(target, draft)
        dev.gpu = True  # the GPU's step; on CPU it runs the same tensor code
        assert dev.generate(PROMPTS[0], gp).output_ids == want


def test_a_tree_engine_verifies_processed_requests_as_chains(target, drafts):
    eng = engine(target, drafts["truncated"], tree="6,3,2")
    gp = GenerationParams(max_new_tokens=N_NEW, processors=PENALTIES)
    r = eng.generate(PROMPTS[0], gp)
    assert r.output_ids == processed_greedy(target, PROMPTS[0], N_NEW, PENALTIES)
    assert r.stats.num_draft_tokens <= 3 * r.stats.num_steps  # chains of k, never a tree's nodes


# ---------------------------------------------------------------- EOS rules

EOS_BIAS = ProcessorParams(logit_bias=((258, 100.0),))  # the tiny model's EOS, made certain


def test_ignore_eos_decodes_through_eos_and_min_tokens_holds_it_back():
    target = tiny(1, eos=True)
    eng = engine(target, build_draft("truncate:1", target))
    first = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=EOS_BIAS))
    assert first.output_ids == [258] and first.finish_reason == "stop"
    through = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=EOS_BIAS, ignore_eos=True))
    assert through.output_ids == [258] * 8 and through.finish_reason == "length"
    held = ProcessorParams(logit_bias=((258, 100.0),), min_tokens=5)
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=held))
    assert len(r.output_ids) == 6 and r.output_ids[-1] == 258 and 258 not in r.output_ids[:5]
    assert r.output_ids == processed_greedy(target, [1, 2, 3], 6, held, stop=(258,))


def test_stop_token_ids_stop_as_eos_does_and_min_tokens_holds_them_back(target, drafts):
    eng = engine(target, drafts["truncated"])
    five = ProcessorParams(logit_bias=((5, 100.0),))
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=five, stop_token_ids=(5,)))
    assert r.output_ids == [5] and r.finish_reason == "stop"
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=five, stop_token_ids=(5,),
                                                 ignore_eos=True))
    assert r.output_ids == [5]  # ignore_eos is about EOS only
    held = ProcessorParams(logit_bias=((5, 100.0),), min_tokens=3)
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=8, processors=held, stop_token_ids=(5, 9)))
    assert len(r.output_ids) == 4 and r.output_ids[-1] == 5 and not {5, 9} & set(r.output_ids[:3])
    assert r.output_ids == processed_greedy(target, [1, 2, 3], 4, held, stop=(5, 9))
    assert GenerationParams(stop_token_ids=(5, 9)).shown(r.output_ids) == r.output_ids[:3]
    assert GenerationParams().shown(r.output_ids) == r.output_ids


def test_bad_processing_values_raise_at_the_call(target):
    eng = engine(target)
    for gp in (GenerationParams(max_new_tokens=4, processors=ProcessorParams(logit_bias=((259, 1.0),))),
               GenerationParams(max_new_tokens=4, processors=ProcessorParams(min_tokens=5)),
               GenerationParams(max_new_tokens=4, stop_token_ids=(259,)),
               GenerationParams(max_new_tokens=4, logprobs=10_000)):
        with pytest.raises(RequestError):
            eng.generate([1, 2], gp)


# ---------------------------------------------------------------- sampling

V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
SAMPLE_PROMPT = [1, 2, 3]
N_SAMPLES = 2000


def exact_first_two(target, params: ProcessorParams, sp: SamplingParams, stop=()) -> torch.Tensor:
    """P(t1, t2) of the processed, warped target from full forwards."""
    p1 = warp_probs(processed_row(target, SAMPLE_PROMPT, [], params, stop), sp)
    p2 = torch.stack([warp_probs(processed_row(target, SAMPLE_PROMPT, [a], params, stop), sp) for a in range(8)])
    return p1[:, None] * p2


@pytest.mark.parametrize("draft_kind, params, sampling", [
    ("normal", ProcessorParams(presence_penalty=1.2, frequency_penalty=0.7, logit_bias=((2, 1.5), (4, -2.0))),
     SamplingParams(temperature=1.0)),
    ("bad", ProcessorParams(repetition_penalty=1.8, logit_bias=((0, 2.0), (3, -100.0)), min_tokens=2),
     SamplingParams(temperature=0.8, top_p=0.95)),
    ("normal", ProcessorParams(presence_penalty=-0.5, repetition_penalty=0.7, min_tokens=2),
     SamplingParams(temperature=1.0, top_k=6)),
])
def test_sampled_first_two_tokens_follow_the_processed_target(draft_kind, params, sampling):
    """Both first positions drafted in one step (k = 2), so the second draft's and the second
    verify row's counts include the first draft: the joint of the two tokens is the processed
    target's. The model has an EOS (id 7): min_tokens must hold it back at both positions."""
    target = tiny(3, layers=2, eos=True, **V8)
    bad = tiny(3, layers=2, eos=True, **V8)
    with torch.no_grad():
        bad.lm_head.weight.mul_(-0.5)  # q proportional to p ** -0.5
    draft = bad if draft_kind == "bad" else build_draft("truncate:1", target)
    eng = SpecEngine(target, draft, options=small_options(k=2, max_seq_len=32, k_policy="fixed"))
    counts = torch.zeros(8, 8)
    drafted = accepted = 0
    for i in range(N_SAMPLES):
        sp = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=i)
        r = eng.generate(SAMPLE_PROMPT, GenerationParams(max_new_tokens=3, sampling=sp, capture=False,
                                                         processors=params, ignore_eos=not params.min_tokens))
        counts[r.output_ids[0], r.output_ids[1]] += 1
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
    assert 0.05 < accepted / drafted < 0.95 and drafted - accepted > 200  # both paths ran often
    stop = (7,) if params.min_tokens else ()
    assert chi2_pvalue(counts, exact_first_two(target, params, sampling, stop)) > 1e-3


# ---------------------------------------------------------------- log-probs and records

def raw_logprobs(model, prompt, out) -> torch.Tensor:
    """[len(out), V]: the raw target's log-probs at each output position, one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("processors", [ProcessorParams(), PENALTIES])
def test_logprobs_with_speculation_equal_those_without(target, drafts, processors):
    gp = GenerationParams(max_new_tokens=N_NEW, processors=processors, logprobs=4)
    ar = engine(target).generate(PROMPTS[0], gp)
    sd = engine(target, drafts["truncated"]).generate(PROMPTS[0], gp)
    assert sd.output_ids == ar.output_ids and sd.stats.num_accepted_tokens > 0
    ref = raw_logprobs(target, PROMPTS[0], ar.output_ids)
    for i, ((lp_a, top_a), (lp_s, top_s)) in enumerate(zip(ar.logprobs, sd.logprobs)):
        assert lp_s == pytest.approx(lp_a, abs=1e-4)
        assert lp_a == pytest.approx(float(ref[i, ar.output_ids[i]]), abs=1e-4)  # raw: no processor, no warp
        assert [t for t, _ in top_s] == [t for t, _ in top_a] == torch.topk(ref[i], 4).indices.tolist()
        assert [v for _, v in top_s] == pytest.approx([v for _, v in top_a], abs=1e-4)
    assert len(sd.logprobs) == N_NEW


def test_sampled_logprobs_and_the_capture_stay_the_raw_targets(target, drafts):
    gp = GenerationParams(max_new_tokens=N_NEW, processors=PENALTIES, logprobs=0,
                          sampling=SamplingParams(temperature=0.7, seed=5))
    r = engine(target, drafts["truncated"]).generate(PROMPTS[2], gp)
    ref = raw_logprobs(target, PROMPTS[2], r.output_ids)
    got = torch.tensor([lp for lp, _ in r.logprobs])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(r.output_ids).unsqueeze(1)).squeeze(1),
                               atol=1e-4, rtol=0)
    assert all(top == [] for _, top in r.logprobs)
    # The record's top-k is the raw target's too: the trainer learns the target, not the penalties.
    top = torch.from_numpy(r.capture.topk_logprobs.astype("float32"))
    torch.testing.assert_close(top, torch.topk(ref, top.shape[1]).values, atol=2e-2, rtol=0)
    assert engine(target).generate(PROMPTS[2], GenerationParams(max_new_tokens=4)).logprobs is None
