"""Prompt prefixes a slot already holds (serve/engine/prefix.py): a new prompt starts from the
longest one, from its own slot, a free slot or a running request, and every request still
gets exactly what it gets without; drafts that read the target's prompt features, and
`prefix_reuse` off, take none."""

import asyncio

import pytest
import torch

from infra.config import OSDConfig
from infra.drafts.head import build_head
from infra.drafts.spec import DraftSpec
from infra.target import build_tiny_llama, load_target
from serve.engine.core import GenerationParams, SpecEngine
from serve.engine.prefix import Reuse, best_prefix, common_prefix
from serve.model import native_build
from serve.model.native_runner import NativeLlamaRunner
from serve.model.runner import StaticKVCache
from serve.sampling.verify import SamplingParams
from serve.spec_decode.specs import build_draft
from engine_options import small_options

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

SYSTEM = list(range(3, 43))  # a shared system turn of 40 tokens


def test_common_prefix_across_strides_and_limits():
    a = list(range(200))
    assert common_prefix(a, a, 500) == 200
    assert common_prefix(a, a, 150) == 150
    assert common_prefix(a, a[:70] + [-1] + a[71:], 500) == 70  # past the first stride of 64
    assert common_prefix(a, [7] + a[1:], 500) == 0
    assert common_prefix(a, a[:5], 500) == 5
    assert common_prefix([], a, 500) == 0
    assert common_prefix(a, tuple(a), 500) == 200  # a tuple holds the same tokens as a list


def test_best_prefix_longest_slot_own_first_and_never_the_last_token():
    prompt = [1, 2, 3, 4, 5]
    others = [("a", [1, 2, 9]), ("b", [1, 2, 3, 8]), ("c", [7])]
    assert best_prefix(prompt, "own", [1], others) == Reuse("b", 3)
    assert best_prefix(prompt, "own", [1, 2, 3], others) == Reuse("own", 3)  # a tie: no copy
    # The whole prompt held: all but its last token, whose logits the request computes.
    assert best_prefix(prompt, "own", [], [("a", [1, 2, 3, 4, 5, 6])]) == Reuse("a", 4)
    assert best_prefix(prompt, "own", [], [("c", [7])]) is None
    assert best_prefix([1], "own", [1], others) is None
    # shrink: a draft that reads features computes the prefix's last position again.
    assert best_prefix(prompt, "own", [1], others, shrink=1) == Reuse("b", 2)
    assert best_prefix(prompt, "own", [1], [("c", [7])], shrink=1) is None


def test_take_prefix_copies_positions_or_keeps_its_own():
    src, dst = (StaticKVCache(2, 1, 16, 4, torch.float32, torch.device("cpu")) for _ in range(2))
    src.k.normal_(), src.v.normal_()
    src.length = 10
    dst.take_prefix(src, 6)
    assert dst.length == 6 and torch.equal(dst.k[:, :, :6], src.k[:, :, :6]) and torch.equal(dst.v[:, :, :6], src.v[:, :, :6])
    assert not dst.k[:, :, 6:].any()
    src.truncate(0)
    src.take_prefix(src, 8)  # its own positions, still there past its length
    assert src.length == 8
    with pytest.raises(ValueError, match="cannot take 17 positions"):
        dst.take_prefix(src, 17)


def tiny():
    m = build_tiny_llama(seed=3, num_layers=2, max_positions=256, vocab_size=300, hidden_size=64,
                         num_heads=4, num_kv_heads=2, intermediate_size=128)
    m.config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def target():
    return tiny()


@pytest.fixture(scope="module")
def native_target():
    if not native_build.supported():
        pytest.skip("this CPU runs no native variant")
    cfg = OSDConfig.model_validate({"model": {"target": "tiny-random", "quant": "int4", "dtype": "bfloat16",
                                              "cpu_kernels": "native"}})
    return load_target("tiny-random", cfg.model, progress=False).model


def _engine(model, reuse=True, draft="suffix", native=False, **kw):
    opts = dict(k=3, max_seq_len=256, max_concurrency=3, prefill_chunk=8, k_policy="fixed", prefix_reuse=reuse)
    if native:
        opts.update(quant="int4", cpu_kernels="native")
    eng = SpecEngine(model, build_draft(draft, model) if draft else None, options=small_options(**{**opts, **kw}))
    assert isinstance(eng.target, NativeLlamaRunner) == native
    return eng


def _conversation(eng, sampled=False):
    """Three requests one after another: a first turn, another first turn with the same system
    turn, and the first conversation's next turn (its prompt, its answer, a new question)."""
    sampling = SamplingParams(temperature=0.8, seed=11) if sampled else SamplingParams()
    params = GenerationParams(max_new_tokens=12, sampling=sampling)
    first = SYSTEM + [200, 201, 202, 203]
    r1 = eng.generate(first, params)
    r2 = eng.generate(SYSTEM + [210, 211], params)
    r3 = eng.generate(first + r1.output_ids + [220, 221, 222], params)
    return [r1, r2, r3]


@pytest.mark.parametrize("path", ["cpu", "device", "native"])
def test_a_conversation_takes_its_prefixes_and_gets_the_same_tokens(target, native_target, path):
    """The second first turn takes the system turn, the next turn the whole first exchange but
    its last token (never in the cache: it is the next forward's input); the tokens are those
    of an engine without prefix reuse, greedy and sampled. device: the GPU's path on the CPU."""
    model = native_target if path == "native" else target
    for sampled in (False, True):
        got, want = [], []
        for reuse, out in ((True, got), (False, want)):
            eng = _engine(model, reuse, native=path == "native")
            eng.gpu = path == "device"
            out += _conversation(eng, sampled)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.cached_tokens for r in want] == [0, 0, 0]
        # The first exchange whole but its last token, unless its budget cut the last step's
        # tokens short of what the cache had committed.
        exchange = len(got[0].prompt_ids) + len(got[0].output_ids)
        assert [r.cached_tokens for r in got[:2]] == [0, len(SYSTEM)] and got[2].cached_tokens in (exchange - 1, exchange)
        assert got[2].usage["prompt_tokens_details"] == {"cached_tokens": got[2].cached_tokens}
        assert eng.scheduler.cached_tokens == 0 and eng.scheduler.prompt_tokens == sum(len(r.prompt_ids) for r in want)


def test_a_prompt_held_whole_ends_its_prefill_at_admission(target):
    eng = _engine(target)
    params = GenerationParams(max_new_tokens=10)
    prompt = SYSTEM + [250, 251]
    a, b = eng.generate(prompt, params), eng.generate(prompt, params)
    assert b.cached_tokens == len(prompt) - 1 and b.output_ids == a.output_ids
    assert eng.scheduler.cached_tokens == len(prompt) - 1


def test_a_running_request_lends_its_prompt_while_it_decodes(target):
    """A request arriving while another decodes copies the system turn from the running one's
    slot; both get their tokens alone."""
    eng = _engine(target)
    params = GenerationParams(max_new_tokens=30)
    p1, p2 = SYSTEM + [200, 201], SYSTEM + [230, 231, 232]
    alone = [_engine(target, reuse=False).generate(p, params).output_ids for p in (p1, p2)]

    async def run():
        async def one(p, delay):
            await asyncio.sleep(delay)
            s = eng.stream(p, params)
            async for _ in s:
                pass
            return s.result

        first = asyncio.ensure_future(one(p1, 0.0))
        while eng.scheduler.log.total < 8:  # the first request is decoding
            await asyncio.sleep(0.001)
        second = await one(p2, 0.0)
        return await first, second

    r1, r2 = asyncio.run(run())
    assert [r1.output_ids, r2.output_ids] == alone
    assert r1.cached_tokens == 0 and r2.cached_tokens == len(SYSTEM)


@pytest.mark.parametrize("family", ["head", "head+suffix"])
def test_a_draft_that_reads_features_takes_its_own_rows_over_the_prefix(target, family):
    """A head reads the target's features of every prompt row: a request takes the head's
    cache rows over the prefix from the same slot and computes the prefix's last position again
    (its features are the head's next input). The tokens equal an engine's without reuse; the
    head's proposals after a taken prefix equal those after a whole prefill."""
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1), draft_vocab=200))

    def engine(reuse):
        eng = _engine(target, reuse, draft=None)
        draft = head if family == "head" else build_draft("suffix", target)
        if family == "head+suffix":
            from serve.spec_decode.suffix.draft import HybridDraft

            draft = HybridDraft(eng.make_draft(head), draft)
        eng.draft = eng.make_draft(draft)
        return eng

    on, off = engine(True), engine(False)
    got, want = _conversation(on), _conversation(off)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.cached_tokens for r in got[:2]] == [0, len(SYSTEM) - 1]
    assert got[2].cached_tokens > len(got[0].prompt_ids)  # the first exchange, as far as the head's rows reach
    assert [r.stats.num_accepted_tokens for r in got] == [r.stats.num_accepted_tokens for r in want]


def test_another_drafts_rows_and_reuse_off_take_none(target):
    """Rows the head's cache holds from another draft are no use to it: a request of a fresh
    draft (a hot swap) computes its prompt whole; so does every request with prefix_reuse off."""
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1), draft_vocab=200))
    eng = _engine(target, draft=None)
    params = GenerationParams(max_new_tokens=8)
    eng.generate(SYSTEM + [1, 2], params, eng.make_draft(head))
    assert eng.generate(SYSTEM + [3, 4], params, eng.make_draft(head)).cached_tokens == 0
    no_draft = GenerationParams(max_new_tokens=8, speculate=False)  # no draft: the target's positions only
    assert eng.generate(SYSTEM + [5, 6], no_draft).cached_tokens == len(SYSTEM)
    assert [r.cached_tokens for r in _conversation(_engine(target, reuse=False))] == [0, 0, 0]


def test_prefixes_stay_within_a_tenant_and_a_cache_salt(target):
    """Another tenant's prompt, or the same tenant's under another cache_salt (vLLM's), is not
    a source: one user cannot time whether another sent a prompt."""
    from serve.engine.tenancy import Origin

    eng = _engine(target, max_concurrency=6)  # a slot each: no request's positions are overwritten

    def run(tenant, salt=None, tail=(200, 201)):
        return eng.generate(SYSTEM + list(tail), GenerationParams(max_new_tokens=6, cache_salt=salt,
                                                                  origin=Origin(tenant=tenant)))

    run("a")
    assert run("b").cached_tokens == 0
    assert run("a", "s1").cached_tokens == 0
    assert run("a", tail=(210, 211)).cached_tokens == len(SYSTEM)
    assert run("a", "s1", tail=(220,)).cached_tokens == len(SYSTEM)
    assert run("b", tail=(230, 231)).cached_tokens == len(SYSTEM)
