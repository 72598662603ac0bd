"""The `suffix` draft (serve/spec_decode/suffix/draft.py) in the engine: greedy output is the target's,
sampling follows the target's distribution, a repeated request is drafted from the replica's
index, opted-out requests never enter it, and every request's state goes when it leaves."""

import asyncio

import pytest
import torch
from chi2 import first_two_tokens_pvalue
from test_batching import tiny

from infra.config import OSDConfig
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.spec_decode.suffix.draft import SuffixDraft
from serve.sampling.verify import SamplingParams

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def target():
    return tiny(layers=2)


def _engine(target, **kw):
    opts = dict(k=4, max_seq_len=160, max_concurrency=4, prefill_chunk=16, k_policy="fixed")
    return SpecEngine(target, build_draft("suffix", target), options=small_options(**{**opts, **kw}))


def _prompts():
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(0, 256, (6,), generator=gen).tolist()
    noise = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 4, 20)]
    # Repeated text inside a prompt: the request's own index proposes from its first step.
    return [motif * 4, noise[0] + motif * 2 + noise[1], noise[2], motif + noise[1] + motif]


def test_greedy_output_is_the_targets_and_a_repeat_is_drafted_from_the_replica(target):
    eng = _engine(target)
    ar = SpecEngine(target, None, options=small_options(k=0, max_seq_len=160, max_concurrency=4))
    prompts = _prompts()
    params = GenerationParams(max_new_tokens=40)
    want = [r.output_ids for r in ar.generate_many(prompts, params)]
    first = eng.generate_many(prompts, params)  # batched, 4 at once
    assert [r.output_ids for r in first] == want
    assert sum(r.stats.num_draft_tokens for r in first) > 0
    # Asked again, one at a time: each answer is in the replica's index now, so nearly every
    # position is drafted and accepted (greedy: the same answer).
    again = [eng.generate(p, params) for p in prompts]
    assert [r.output_ids for r in again] == want
    drafted = sum(r.stats.num_draft_tokens for r in again)
    accepted = sum(r.stats.num_accepted_tokens for r in again)
    assert accepted / drafted > 0.9 and accepted > 0.5 * 4 * 40
    assert eng.draft.proposer.global_index.n_tokens > 0
    assert eng.draft.proposer._requests == {}  # per-request state gone with each request


def test_a_repeat_verifies_chains_longer_than_k_up_to_max_chain(target):
    """A chain is chosen, not drafted: a repeat's chain runs past the engine's k, to
    the suffix draft's max_chain, and the output is still the target's."""
    opts = small_options(k=2, max_seq_len=160, max_concurrency=4, k_policy="fixed")
    eng = SpecEngine(target, SuffixDraft(target.config.vocab_size, max_chain=7), options=opts)
    ar = SpecEngine(target, None, options=small_options(k=0, max_seq_len=160))
    prompt, params = _prompts()[2], GenerationParams(max_new_tokens=40)
    want = ar.generate(prompt, params).output_ids
    assert eng.generate(prompt, params).output_ids == want
    again = eng.generate(prompt, params)  # its answer is in the replica's index now
    assert again.output_ids == want
    assert len(again.stats.drafted_per_pos) == 7 and again.stats.accepted_per_pos[6] > 0
    assert again.stats.num_steps <= 40 / 4


def test_a_request_that_opted_out_of_capture_never_enters_the_shared_index(target):
    eng = _engine(target)
    eng.generate(_prompts()[0], GenerationParams(max_new_tokens=20, capture=False))
    assert eng.draft.proposer.global_index.n_tokens == 0
    eng.generate(_prompts()[0], GenerationParams(max_new_tokens=20))
    assert eng.draft.proposer.global_index.n_tokens > 0


def test_a_tenant_never_drafts_from_another_tenants_outputs(target):
    """One index per tenant (serve/engine/tenancy.py suffix_pool): acme's repeat is drafted from its
    own earlier answer, beta asking the same gets nothing of it."""
    from serve.engine.tenancy import Origin

    eng = _engine(target)
    prompt = _prompts()[2]  # no repeats inside: the request's own index has nothing to propose

    def run(tenant):
        return eng.generate(prompt, GenerationParams(max_new_tokens=40, origin=Origin(tenant, None, "r", tenant)))

    first = run("acme")
    acme_again, beta = run("acme"), run("beta")
    assert acme_again.output_ids == beta.output_ids == first.output_ids  # greedy: the target's answer
    assert acme_again.stats.num_accepted_tokens > 0.8 * len(first.output_ids)
    # beta drafts exactly as acme's first request did, from nothing but its own text.
    assert (beta.stats.num_draft_tokens, beta.stats.num_accepted_tokens) == (
        first.stats.num_draft_tokens, first.stats.num_accepted_tokens)
    assert set(eng.draft.proposer.pools) == {None, "acme", "beta"} and eng.draft.proposer.global_index.n_tokens == 0


def test_a_cancelled_stream_leaves_no_state_and_adds_nothing(target):
    eng = _engine(target)

    async def run():
        stream = eng.stream(_prompts()[0], GenerationParams(max_new_tokens=60))
        async for _ in stream:
            break  # the client goes away after its first tokens
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(run())
    eng.generate([1, 2, 3], GenerationParams(max_new_tokens=2))  # a step retires the cancelled one
    assert eng.draft.proposer._requests == {}
    assert eng.slots.free == 4
    assert eng.draft.proposer.global_index.n_tokens == 2 + 3  # only the finished request: tail + output


V8 = dict(vocab=8, layers=2, max_positions=40)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # the request's own index proposes 3, 1, 2, ...


def test_sampled_requests_follow_the_target_with_proposals_and_without():
    """Some steps draft (the prompt's own repeat, and answers shared through the replica's
    index), some find no match and draft nothing; the first two tokens' joint counts follow
    the target's exact distribution, and seeds reproduce."""
    target = tiny(seed=3, **V8)
    eng = SpecEngine(target, build_draft("suffix", target),
                     options=small_options(k=3, max_seq_len=40, max_concurrency=4, k_policy="fixed"))
    sp = SamplingParams(temperature=1.0)
    n = 1200
    params = [GenerationParams(max_new_tokens=3, sampling=SamplingParams(1.0, seed=i)) for i in range(n)]
    results = [eng.generate(PROMPT, p) for p in params]
    assert first_two_tokens_pvalue(target, PROMPT, [r.output_ids for r in results], 8, sp) > 1e-3
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert 0 < accepted < drafted  # proposals were made, and some were rejected
    assert [eng.generate(PROMPT, p).output_ids for p in params[:30]] == [r.output_ids for r in results[:30]]


def test_suffix_settings_come_from_the_config():
    from infra.config import RetiredSettingWarning

    cfg = OSDConfig.model_validate({"serve": {"suffix": {"max_tokens": 1000}}})
    d = build_draft("suffix", tiny(**V8), suffix=cfg.serve.suffix)
    assert isinstance(d, SuffixDraft) and d.proposer.global_index.max_tokens == 1000
    assert (d.min_prob, d.max_chain) == (0.1, 15)  # the draft's own, no longer settings
    with pytest.warns(RetiredSettingWarning, match=r"serve\.suffix\.min_prob .*SuffixDraft"):
        OSDConfig.model_validate({"serve": {"suffix": {"min_prob": 0.3}}})
    # A chain past 15 tokens would verify 17+ rows, which no longer attend as decoding does.
    for bad in (0, 16):
        with pytest.raises(ValueError, match="max_chain"):
            SuffixDraft(8, max_chain=bad)


def test_the_device_stages_serve_the_suffix_draft_as_the_cpu_batch_does(target):
    """The CUDA path's loop (run here on CPU): the same tokens, drafts and records."""
    prompts = _prompts()
    cpu, dev = _engine(target), _engine(target)
    dev.gpu = True  # the GPU's step; on CPU it runs the same tensor code
    for p in prompts + prompts:  # the second round drafts from the replica's index
        for params in (GenerationParams(max_new_tokens=24),
                       GenerationParams(max_new_tokens=24, sampling=SamplingParams(0.8, seed=7))):
            a, b = cpu.generate(p, params), dev.generate(p, params)
            assert b.output_ids == a.output_ids
            assert b.capture.draft_tokens.tolist() == a.capture.draft_tokens.tolist()
    assert dev.draft.proposer.global_index.n_tokens == cpu.draft.proposer.global_index.n_tokens > 0


# ---------------------------------------------------------------- head+suffix

def test_head_with_suffix_is_the_target_greedy_and_takes_the_suffix_on_repeats(target):
    eng = SpecEngine(target, build_draft("head:untrained+suffix", target),
                     options=small_options(k=4, max_seq_len=160, max_concurrency=4, prefill_chunk=16))
    ar = SpecEngine(target, None, options=small_options(k=0, max_seq_len=160, max_concurrency=4))
    prompts = _prompts()
    params = GenerationParams(max_new_tokens=40)
    want = [r.output_ids for r in ar.generate_many(prompts, params)]
    first = eng.generate_many(prompts, params)
    again = eng.generate_many(prompts, params)  # every answer is in the replica's index now
    assert [r.output_ids for r in first] == want and [r.output_ids for r in again] == want
    sources = {}
    for r in first + again:
        for src, counts in r.stats.by_source.items():
            sources[src] = [a + b for a, b in zip(sources.get(src, [0, 0, 0]), counts)]
    assert "suffix" in sources
    steps, drafted, accepted = sources["suffix"]
    assert accepted / drafted > 0.8  # the suffix wins where it has seen the answer
    assert eng.draft.suffix.proposer._requests == {}


def test_head_with_suffix_samples_the_target_distribution():
    target = tiny(seed=3, **V8)
    eng = SpecEngine(target, build_draft("head:untrained+suffix", target),
                     options=small_options(k=3, max_seq_len=40, max_concurrency=4, k_policy="fixed"))
    n = 1200
    params = [GenerationParams(max_new_tokens=3, sampling=SamplingParams(1.0, seed=i)) for i in range(n)]
    results = [eng.generate(PROMPT, p) for p in params]
    assert first_two_tokens_pvalue(target, PROMPT, [r.output_ids for r in results], 8, SamplingParams(1.0)) > 1e-3
    used = {src for r in results for src in r.stats.by_source}
    assert used == {"head", "suffix"}  # both kinds of step ran


def test_only_a_head_takes_a_suffix_beside_it(target, tmp_path):
    from infra.drafts.spec import DraftSpecError
    from serve.spec_decode.specs import resolve_auto

    with pytest.raises(DraftSpecError, match="must be a head"):
        build_draft("truncate:1+suffix", target)
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "serve": {"draft": "head+suffix"}})
    with pytest.raises(DraftSpecError, match="osd draft init --family head"):
        resolve_auto(cfg)
    from pipeline.stack.launch import LaunchError, with_draft_resolved

    with pytest.raises(LaunchError, match="osd draft init --family head"):  # `osd serve`: a clear error
        with_draft_resolved(cfg)


# ---------------------------------------------------------------- warmed from the stream

def _record(i, prompt, output):
    import numpy as np

    from infra.records.schema import Record

    n = len(output)
    return Record(request_id=f"r{i}", draft_version="v1", prompt_ids=np.asarray(prompt, np.int32),
                  output_ids=np.asarray(output, np.int32), topk_ids=np.zeros((n, 2), np.int32),
                  topk_logprobs=np.zeros((n, 2), np.float16), accepted=np.zeros(n, bool),
                  draft_tokens=np.full(n, -1, np.int32), draft_probs=np.full(n, np.nan, np.float32))


@pytest.mark.redis
def test_recent_records_are_the_newest_by_tokens_oldest_first_and_leave_groups_alone(redis_url):
    from infra.config import StreamConfig
    from infra.records.schema import encode
    from infra.records.streams import FIELD, RecordConsumer, connect, recent_records

    c = StreamConfig(stream="osd:suffix-test", block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5)
    consumer = RecordConsumer(redis_url, c, name="a")
    client = connect(redis_url, c)
    for i in range(10):
        client.xadd(c.stream, {FIELD: encode(_record(i, [1, 2], list(range(16))))})
        if i == 7:
            client.xadd(c.stream, {FIELD: b"junk"})
    got = recent_records(client, c.stream, max_tokens=40, batch=2)  # pages of 2, junk skipped
    assert [r.request_id for r in got] == ["r7", "r8", "r9"]  # 48 tokens: the one crossing 40 included
    assert len(recent_records(client, c.stream, max_tokens=10**6)) == 10
    assert consumer.lag() == 11 and consumer.pending() == 0  # a reader, not a consumer


def test_a_new_replica_warmed_from_records_drafts_the_repeats_at_once(target):
    from serve.spec_decode.suffix.draft import suffix_of, warm_from_records

    prompts = _prompts()
    params = GenerationParams(max_new_tokens=40)
    served = _engine(target).generate_many(prompts, params)  # the replica before the restart
    records = [_record(i, r.prompt_ids, r.output_ids) for i, r in enumerate(served)]
    fresh = _engine(target)
    assert warm_from_records(suffix_of(fresh.draft), records) == sum(min(32, len(p)) + 40 for p in prompts)
    again = [fresh.generate(p, params) for p in prompts]
    assert [r.output_ids for r in again] == [r.output_ids for r in served]
    drafted = sum(r.stats.num_draft_tokens for r in again)
    accepted = sum(r.stats.num_accepted_tokens for r in again)
    assert accepted / drafted > 0.9 and accepted > 0.5 * 4 * 40
    cold = [_engine(target).generate(p, params) for p in prompts]  # no warm start: far less drafted
    assert sum(r.stats.num_accepted_tokens for r in cold) < accepted / 2


@pytest.mark.redis
def test_a_replica_with_the_suffix_draft_starts_from_the_streams_records(redis_url, tmp_path):
    from infra.config import StreamConfig
    from infra.records.schema import encode
    from infra.records.streams import FIELD, connect
    from serve.api.app import TargetReplica

    c = StreamConfig(stream="osd:suffix-replica", block_ms=100, socket_timeout_s=1.0, connect_timeout_s=0.5)
    client = connect(redis_url, c)
    for i in range(3):
        client.xadd(c.stream, {FIELD: encode(_record(i, [1, 2, 3], [7, 8, 9, 10 + i]))})
    cfg = OSDConfig.model_validate({"state_dir": str(tmp_path), "model": {"target": "tiny-random"},
                                    "serve": {"draft": "suffix"}, "stream": {**c.model_dump(), "redis_url": redis_url}})
    rep = TargetReplica(cfg.model_dump(mode="json"))
    try:
        assert rep.router.routing.stable_runner.proposer.global_index.n_tokens == 3 * (3 + 4)
    finally:
        rep.close()
    # A stream that cannot be reached leaves the index empty and the replica serving.
    down = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"redis_url": "redis://127.0.0.1:1"})})
    rep = TargetReplica(down.model_dump(mode="json"))
    try:
        assert rep.router.routing.stable_runner.proposer.global_index.n_tokens == 0
    finally:
        rep.close()


class _Seq:
    """Just what SuffixDraft reads of a request."""

    def __init__(self, tokens):
        from types import SimpleNamespace

        self.tokens = list(tokens)
        self.device = torch.device("cpu")
        self.draft_state = {}
        self.step_source = "suffix"
        self.params = SimpleNamespace(origin=SimpleNamespace(pool=None), capture=False)


def _lookups(draft, seq, steps, seqs):
    """Which of `steps` steps looked the index up, for a request in a step of `seqs` requests."""
    from serve.spec_decode.protocol import StepContext

    ctx = StepContext(0.0, 4, lambda s: 8, None, rows=seqs, seqs=seqs)
    asked = []
    for step in range(steps):
        before = draft.asked
        got = draft.propose([seq], [0], ctx)[0]
        asked.append(draft.asked > before)
        draft.commit(seq, len(seq.tokens), 0, got.tokens.numel(), None)  # nothing accepted
        seq.tokens.append(1000 + step)  # text the index has never seen: no match ahead
    return [i for i, a in enumerate(asked) if a]


def test_a_request_in_a_batch_backs_off_lookups_that_find_nothing_and_alone_never_does():
    draft = SuffixDraft(2048)
    alone = _Seq(range(40))
    assert _lookups(draft, alone, 12, seqs=1) == list(range(12))
    crowded = _Seq(range(40))
    # Waits of 1, 3, 7, then 15 steps between lookups, capped by the 15 other requests.
    assert _lookups(draft, crowded, 64, seqs=16) == [0, 2, 6, 14, 30, 46, 62]
    capped = _Seq(range(40))
    assert _lookups(draft, capped, 20, seqs=4) == [0, 2, 6, 10, 14, 18]


def test_an_accepted_chain_brings_the_lookups_back_to_every_step():
    from serve.spec_decode.protocol import StepContext

    draft = SuffixDraft(2048)
    motif = [5, 6, 7, 8, 9, 10, 11, 12]
    seq = _Seq(motif * 3 + [99, 98])
    ctx = StepContext(0.0, 4, lambda s: 8, None, rows=8, seqs=8)
    st_misses = lambda: seq.draft_state["suffix"].misses  # noqa: E731
    draft.propose([seq], [0], ctx)
    seq.draft_state["suffix"].misses = 3  # as after three empty lookups
    seq.tokens += motif[:2]  # the motif again: the request's own index has its continuation
    for _ in range(8):  # wait out the back-off (7 steps) to the next lookup
        got = draft.propose([seq], [0], ctx)[0]
        if got.tokens.numel():
            break
    assert got.tokens.numel() > 0
    draft.commit(seq, len(seq.tokens), 1, got.tokens.numel(), None)
    assert st_misses() == 0
    seq.tokens += got.tokens[:1].tolist() + [motif[3]]
    assert draft.propose([seq], [0], ctx)[0].tokens.numel() > 0  # looked up at once


class _SlowHead:
    """A head whose batched proposal takes `delay` seconds: one token for every request."""
    feature_layers, vocab_size, max_seq_len, device = (), 2048, 1 << 20, torch.device("cpu")

    def __init__(self, delay):
        self.delay = delay

    def propose(self, seqs, ks, ctx):
        import time

        from serve.spec_decode.protocol import Proposal

        time.sleep(self.delay)
        return [Proposal(torch.tensor([7]), None, [0.5], "head") for _ in seqs]


def test_the_hybrid_charges_the_heads_forward_to_the_heads_chains_alone():
    """A batched step's draft seconds per request go to the draft-length policy as that draft's
    cost per token: shared out by tokens over the hybrid's call, a batch's suffix chains took
    most of the head's forward and the head looked cheap under load."""
    from serve.engine.step import propose_all
    from serve.spec_decode.protocol import StepContext
    from serve.spec_decode.suffix.draft import HybridDraft

    delay = 0.2
    draft = HybridDraft(_SlowHead(delay), SuffixDraft(2048))
    motif = [5, 6, 7, 8, 9, 10, 11, 12]
    seqs = [_Seq(motif * 4 + [5, 6]), _Seq(range(100, 140)), _Seq(range(200, 240))]
    for s in seqs:
        s.length, s.draft = None, draft
    ctx = StepContext(0.0, 4, lambda s: 8, None, rows=3, seqs=3)
    eng = type("Eng", (), {"device": torch.device("cpu"), "step_context": lambda self, seqs, ks: ctx})()
    got = propose_all(eng, seqs, [1, 1, 1])
    (rep, rep_s), (new1, new1_s), (new2, new2_s) = got
    assert rep.source == "suffix" and rep.tokens.numel() > 1  # the repeat: a suffix chain
    assert new1.source == new2.source == "head"
    assert rep_s < delay / 2  # a lookup, none of the head's forward
    assert new1_s >= delay / 2 and new2_s >= delay / 2 and new1_s + new2_s >= delay  # the forward, shared by the two
