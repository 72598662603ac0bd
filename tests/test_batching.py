"""Continuous batching (serve/engine/scheduler.py): requests decoding together in one forward a step
give each request what it gets alone, greedy and sampled, with its records; chunked prefill;
and the load-adaptive draft length (serve/spec_decode/k_policy.py plan_batch)."""

import asyncio

import pytest
import torch
from chi2 import first_two_tokens_pvalue

from infra.target import build_tiny_llama
from serve.model.batch_forward import Item, forward_batch
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options, stream_all
from serve.spec_decode.k_policy import plan_batch
from serve.model.runner import LlamaRunner
from serve.sampling.verify import SamplingParams

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


def tiny(seed=5, vocab=300, layers=3, max_positions=160):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=max_positions, vocab_size=vocab,
                         hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    m.config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def target():
    return tiny()


def _engine(target, **kw):
    opts = dict(k=3, max_seq_len=160, max_concurrency=4, prefill_chunk=8, k_policy="fixed")
    return SpecEngine(target, build_draft("truncate:1", target), options=small_options(**{**opts, **kw}))


# (prompt, max_new_tokens, draft: "own" | "other" | None, start delay in steps-ish seconds)
def _requests():
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(0, 256, (n,), generator=gen).tolist()

    return [(prompt(5), 24, "own", 0.0), (prompt(37), 16, None, 0.0), (prompt(3), 30, "other", 0.02),
            (prompt(12), 8, "own", 0.05), (prompt(1), 20, "own", 0.08), (prompt(50), 12, "other", 0.1)]


PATHS = ["cpu", "device"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("path", PATHS)
def test_greedy_outputs_in_a_batch_equal_each_request_alone(target, path):
    """Mixed prompt lengths (one prefilled in 7 chunks, one of a single token), mixed drafts
    (the engine's, another, none), staggered arrivals: requests join and leave mid-batch; one
    more is cancelled half-way, and its slot comes back. device: the GPU's path run on the CPU
    (the pool forward, and its one host read a step, alone or in a batch); cuda: on
    a GPU, with CUDA graphs."""
    if path == "cuda":
        target = tiny().to("cuda")
    eng = _engine(target)
    if path == "device":
        eng.gpu = True  # the GPU's path; on CPU it runs the same tensor code
    drafts = {"own": eng.draft, "other": eng.make_draft(build_draft("truncate:2", target)), None: None}
    reqs = _requests()
    alone = [eng.generate(p, GenerationParams(max_new_tokens=n), drafts[d]).output_ids for p, n, d, _ in reqs]

    async def one(p, n, d, delay):
        await asyncio.sleep(delay)
        stream = eng.stream(p, GenerationParams(max_new_tokens=n), drafts[d])
        async for _ in stream:
            pass
        return stream.result

    async def cancelled():
        stream = eng.stream([7, 8, 9], GenerationParams(max_new_tokens=60))
        got = []
        async for toks in stream:
            got += toks
            if len(got) >= 5:
                break
        return got

    async def run():
        return await asyncio.gather(*[one(*r) for r in reqs], cancelled())

    *batched, partial = asyncio.run(run())
    assert len(partial) >= 5
    for r, want in zip(batched, alone):
        assert r.output_ids == want
    assert any(r.stats.num_draft_tokens for r in batched)
    assert max(n for _, n, _ in eng.scheduler.log.steps) > 1  # they did share forwards
    _wait_free(eng, 4)


def _wait_free(eng, n, timeout=10.0):
    import time

    end = time.monotonic() + timeout
    while eng.slots.free != n and time.monotonic() < end:
        time.sleep(0.01)
    assert eng.slots.free == n


def test_capture_records_of_batched_requests_equal_solo_ones(target):
    eng = _engine(target, k_policy="fixed")
    reqs = [r for r in _requests() if r[2] == "own"]
    params = [GenerationParams(max_new_tokens=n) for _, n, _, _ in reqs]
    alone = [eng.generate(p, gp) for (p, *_), gp in zip(reqs, params)]
    together = stream_all(eng, [r[0] for r in reqs], params)
    for a, b in zip(alone, together):
        assert a.output_ids == b.output_ids
        ca, cb = a.capture, b.capture
        assert (ca.topk_ids == cb.topk_ids).all() and (ca.tokens == cb.tokens).all()
        assert abs(ca.topk_logprobs.astype("float32") - cb.topk_logprobs.astype("float32")).max() <= 2e-3
        assert (ca.accepted == cb.accepted).all() and (ca.draft_tokens == cb.draft_tokens).all()
        assert len(ca) == len(a.output_ids)


V8 = dict(vocab=8, layers=2, max_positions=32)
PROMPT = [1, 2, 3]


def _head_draft(target, d2t):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1)), d2t)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return head


@pytest.mark.parametrize("draft", ["truncate:1", "head"])
def test_sampled_requests_in_a_batch_follow_the_target_and_reproduce_their_seeds(draft):
    """Head drafts propose together (one head forward per position); its q covers 5 of the 8
    target tokens, so the residual path is exercised too."""
    target = tiny(seed=3, **V8)
    d = build_draft(draft, target) if draft != "head" else _head_draft(target, torch.tensor([0, 2, 3, 5, 6]))
    eng = SpecEngine(target, d, options=small_options(k=2, max_seq_len=32, max_concurrency=4, k_policy="fixed"))
    sp = SamplingParams(temperature=1.0)
    n = 1200
    prompts = [PROMPT] * n
    seeded = [GenerationParams(max_new_tokens=3, sampling=SamplingParams(1.0, seed=i), capture=False) for i in range(n)]
    results = _gen_each(eng, prompts, seeded)
    assert first_two_tokens_pvalue(target, PROMPT, [r.output_ids for r in results], 8, sp) > 1e-3
    assert sum(r.stats.num_draft_tokens - r.stats.num_accepted_tokens for r in results) > 100
    again = _gen_each(eng, prompts[:40], seeded[:40])
    assert [r.output_ids for r in again] == [r.output_ids for r in results[:40]]


def _gen_each(eng, prompts, params):
    """Requests with their own parameters, 4 at a time in one batch."""
    out = []
    for lo in range(0, len(prompts), 4):
        out += stream_all(eng, prompts[lo:lo + 4], params[lo:lo + 4])
    return out


def test_generate_many_runs_requests_together_in_order(target):
    eng = _engine(target, max_concurrency=3)
    prompts = [r[0] for r in _requests()]
    gp = GenerationParams(max_new_tokens=6)
    seen = []
    got = eng.generate_many(prompts, gp, on_result=lambda i, r: seen.append(i))
    assert [r.output_ids for r in got] == [eng.generate(p, gp).output_ids for p in prompts]
    assert sorted(seen) == list(range(len(prompts)))
    assert max(n for _, n, _ in eng.scheduler.log.steps) == 3


def test_chunked_prefill_gives_the_logits_of_a_one_shot_prefill():
    model = tiny(seed=8)
    runner = LlamaRunner(model, 160)
    prompt = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(3))
    one = runner.new_cache()
    runner.prefill(prompt[:-1], one)
    want = runner.forward(prompt[-1:], one)
    caches = runner.new_caches(2)
    other = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4))
    runner.prefill(other, caches[1])
    for lo in range(0, 44, 16):  # chunks of 16, 16, 12 beside another sequence's decode rows
        forward_batch(runner, [Item(prompt[lo:min(lo + 16, 44)], caches[0], logits=False),
                               Item(other[-1:], caches[1])])
        caches[1].truncate(9)
    got = runner.forward(prompt[-1:], caches[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_prompt_is_prefilled_a_chunk_a_step_between_the_running_requests(target):
    """A long prompt arriving while another request decodes: the running request keeps taking
    a step with every chunk (never waits for the whole prefill)."""
    eng = _engine(target, prefill_chunk=8)

    async def run():
        first = eng.stream([5, 6, 7], GenerationParams(max_new_tokens=40))
        got = []
        it = first.__aiter__()
        got += await it.__anext__()
        long = eng.stream(list(range(1, 81)), GenerationParams(max_new_tokens=2))
        task = asyncio.create_task(_drain(long))
        while not task.done():
            got += await it.__anext__()
        await task
        async for toks in it:
            got += toks
        return got

    asyncio.run(run())
    steps = list(eng.scheduler.log.steps)
    # 79 prompt tokens in chunks of 8: 10 chunk steps, each also carrying the running request.
    assert sum(1 for _, seqs, rows in steps if seqs == 2 and rows > 8) >= 9


async def _drain(stream):
    async for _ in stream:
        pass
    return stream.result


# -- the load-adaptive rule (pure) ---------------------------------------------------


def _profile(per_row_ms, fixed_ms=10.0, n=64):
    return [(fixed_ms + per_row_ms * r) / 1e3 for r in range(1, n + 1)]


def test_one_sequence_plans_as_the_single_request_rule():
    from serve.spec_decode.k_policy import best_k

    v = _profile(0.5)
    for alpha in (0.1, 0.4, 0.8):
        assert plan_batch(v, 1, [alpha], [4], [0.001], 0.0) == [best_k(v[:5], 0.001, 0.0, alpha, 4)]


def test_drafting_shrinks_as_the_batch_cost_of_a_row_rises():
    alphas = [0.6] * 8
    drafted = [sum(plan_batch(_profile(per_row), 8, alphas, [4] * 8, [0.0005] * 8, 0.0))
               for per_row in (0.05, 0.5, 2.0, 8.0)]
    assert drafted == sorted(drafted, reverse=True) and drafted[0] > 0 and drafted[-1] == 0


def test_more_sequences_draft_less_each_on_a_compute_bound_profile():
    # Cheap rows up to 8, then each row costs as much as a decode step's fixed part.
    v = [0.010 + 0.0002 * r if r <= 8 else 0.0116 + 0.004 * (r - 8) for r in range(1, 65)]
    per_seq = [sum(plan_batch(v, b, [0.5] * b, [4] * b, [0.0002] * b, 0.0)) / b for b in (1, 2, 4, 8, 16)]
    assert per_seq == sorted(per_seq, reverse=True) and per_seq[0] >= 2 and per_seq[-1] == 0


def test_a_plan_never_models_a_lower_rate_than_not_drafting():
    v = _profile(1.0)
    alphas = [0.9, 0.2, 0.5, 0.0]
    ks = plan_batch(v, 4, alphas, [4] * 4, [0.002] * 4, 0.001)

    def rate(ks):
        tokens = sum(sum(a ** j for j in range(k + 1)) for a, k in zip(alphas, ks))
        return tokens / (v[4 + sum(ks) - 1] + 0.002 * sum(ks) + 0.001)

    assert rate(ks) >= rate([0] * 4)
    assert ks[3] == 0 and ks[0] >= ks[2] >= ks[1]


def test_prompt_chunks_shrink_while_they_slow_the_streams_and_grow_back(target):
    from serve.engine.scheduler import MIN_CHUNK, PREFILL_DELAY

    sched = _engine(target, prefill_chunk=64).scheduler
    sched._pace(0.030, chunked=False)  # a decode step: 30 ms
    seen = []
    for _ in range(6):  # steps with a chunk take 4 decode steps
        sched._pace(0.120, chunked=True)
        seen.append(sched.chunk)
    assert seen == sorted(seen, reverse=True) and seen[0] < 64 and seen[-1] >= MIN_CHUNK
    for _ in range(20):  # now they take 1.2: chunks grow, never past prefill_chunk
        sched._pace(0.030 * (PREFILL_DELAY - 0.8), chunked=True)
    assert sched.chunk == 64


def test_head_drafts_of_a_batch_draft_together_and_stay_exact(monkeypatch):
    """Three requests with one head draft: one head forward per draft position for all of them,
    and each output equals the request alone (greedy), as the target's own greedy."""
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec
    from serve.spec_decode.head import draft as head_runner

    target = tiny(seed=11, layers=4)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 3)), torch.arange(300))
    with torch.no_grad():  # a random head that proposes something
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    eng = SpecEngine(target, head, options=small_options(k=3, max_seq_len=160, max_concurrency=3, k_policy="fixed"))
    gp = GenerationParams(max_new_tokens=20)
    prompts = [[5, 9, 13, 200], [42, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    alone = [eng.generate(p, gp).output_ids for p in prompts]
    widths = []
    real = head_runner.HeadRunner.rows_batch
    monkeypatch.setattr(head_runner.HeadRunner, "rows_batch",
                        lambda self, gs, nexts, caches: (widths.append(len(gs)), real(self, gs, nexts, caches))[1])
    together = stream_all(eng, prompts, [gp] * 3)
    assert [r.output_ids for r in together] == alone
    assert max(widths) == 3 and sum(r.stats.num_draft_tokens for r in together) > 0
    with torch.no_grad():
        ref = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20)[0, len(p):].tolist()
               for p in prompts]
    assert alone == ref


def test_a_steps_capture_topk_is_computed_once_and_equals_each_requests_own():
    from types import SimpleNamespace

    from infra.records.tokens import topk_logprobs
    from serve.engine.step import _capture_topk

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(t, 300, generator=g) for t in (1, 4, 1, 2)]
    cap = SimpleNamespace(top_k=5)
    batch = [SimpleNamespace(capture=c) for c in (cap, cap, None, cap)]
    got = _capture_topk(batch, logits)
    assert got[2] is None
    for i in (0, 1, 3):
        ids, lps = topk_logprobs(logits[i], 5)
        assert torch.equal(got[i][0], ids) and torch.equal(got[i][1], lps)
    # one capturing request, or captures of different top_k: each computes its own
    assert _capture_topk(batch[:3][::2], logits[:3][::2]) == [None, None]
    other = [SimpleNamespace(capture=SimpleNamespace(top_k=3))] + batch[1:]
    assert _capture_topk(other, logits) == [None] * 4


def test_prompt_rows_in_a_step_do_not_make_draft_rows_look_cheap():
    """A step with a 128-row prompt chunk beside 16 decoding sequences: counted as nothing,
    the chunk's cost dilutes the step's rate and a draft at acceptance 0.5 looks worth its
    rows; valued as the tokens their compute stands for, the step drafts as it would without
    the chunk or less."""
    v = _profile(0.6, n=256)
    alphas, caps, draft_s = [0.5] * 16, [4] * 16, [0.0002] * 16
    base = 16 + 128
    blind = sum(plan_batch(v, base, alphas, caps, draft_s, 0.0))
    valued = sum(plan_batch(v, base, alphas, caps, draft_s, 0.0, prompt_rows=128))
    alone = sum(plan_batch(v, 16, alphas, caps, draft_s, 0.0))
    assert blind > 0 and valued <= alone < blind
    # A free draft worth nearly a whole row still rides beside the chunk.
    assert sum(plan_batch(v, base, [0.99] * 16, caps, [0.0] * 16, 0.0, prompt_rows=128)) > 0
