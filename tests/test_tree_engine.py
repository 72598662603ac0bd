"""Tree steps in the engine (serve/spec_decode/trees/stages.py) on tiny random Llamas: greedy output equals
the target's, sampled output follows the target's distribution (chi-square), a width-1 tree is
the chain, and the compacted cache is the cache of decoding the accepted tokens directly."""

import pytest
import torch
from chi2 import chi2_pvalue

from infra.target import build_tiny_llama
from serve.spec_decode.specs import build_draft
from serve.engine.core import EngineError, GenerationParams, SpecEngine
from engine_options import small_options, stream_all
from serve.spec_decode.trees.stages import TreeShape, tree_verify
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

SMALL = dict(vocab_size=12, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def tiny(seed=0, layers=3, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=96, **kw)
    m.config.eos_token_id = None
    return m


def engine(target, draft, tree, k=4, **kw):
    return SpecEngine(target, draft, options=small_options(k=k, max_seq_len=96, max_concurrency=1, tree=tree, **kw))


def ar(target, prompt, n):
    return SpecEngine(target, options=small_options(k=0, max_seq_len=96)).generate(
        prompt, GenerationParams(max_new_tokens=n)).output_ids


@pytest.mark.parametrize("tree", ["2,1,1", "5,4,1", "8,3,2", "16,4,4", "6,5,3"])
@pytest.mark.parametrize("small", [False, True])
def test_tree_greedy_output_equals_the_targets(tree, small):
    """A small vocab makes the random draft agree often, so deep paths are accepted and
    compacted; the default vocab exercises early rejections."""
    kw = SMALL if small else {}
    target = tiny(**kw)
    draft = build_draft("truncate:2", target)
    prompt = [1, 2, 3, 4, 5, 6, 7] if small else [17, 200, 3, 99, 45]
    got = engine(target, draft, tree).generate(prompt, GenerationParams(max_new_tokens=30))
    assert got.output_ids == ar(target, prompt, 30)
    assert got.stats.num_steps < 30 or not small  # trees do accept something on the small vocab


def test_a_width_one_tree_is_the_chain():
    target = tiny(**SMALL)
    draft = build_draft("truncate:2", target)
    prompt = [1, 2, 3, 4, 5]
    chain = engine(target, draft, "", k=3, k_policy="fixed").generate(prompt, GenerationParams(max_new_tokens=24))
    tree = engine(target, draft, "4,3,1", k=3).generate(prompt, GenerationParams(max_new_tokens=24))
    assert tree.output_ids == chain.output_ids
    assert tree.stats.num_emitted_tokens == chain.stats.num_emitted_tokens
    assert tree.stats.num_steps == chain.stats.num_steps


def test_the_compacted_cache_equals_decoding_the_accepted_tokens():
    target = tiny(**SMALL)
    eng = engine(target, build_draft("truncate:2", target), "8,3,3")
    prompt = [1, 2, 3, 4, 5, 6]
    out = eng.generate(prompt, GenerationParams(max_new_tokens=20)).output_ids
    cache = eng.slots._free[0].target
    fresh = eng.target.new_cache()
    eng.target.forward(torch.tensor(prompt + out[:-1]), fresh)
    n = len(prompt) + len(out) - 1
    assert cache.length >= n
    torch.testing.assert_close(cache.k[:, :, :n], fresh.k[:, :, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :n], fresh.v[:, :, :n], rtol=1e-4, atol=1e-5)


def test_trees_accept_more_per_step_than_the_chain_of_their_depth():
    """Same draft, same depth: more candidates per level can only help the walk."""
    target = tiny(**SMALL)
    draft = build_draft("truncate:1", target)
    prompt = [1, 2, 3, 4, 5, 6]
    chain = engine(target, draft, "4,3,1").generate(prompt, GenerationParams(max_new_tokens=40))
    wide = engine(target, draft, "16,3,4").generate(prompt, GenerationParams(max_new_tokens=40))
    assert wide.output_ids == chain.output_ids
    assert wide.stats.mean_accepted_len >= chain.stats.mean_accepted_len


# ---------------------------------------------------------------- sampled trees

V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
N_SAMPLES = 1500


def _v8_draft(kind, target):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    if kind == "head":  # target tokens 1, 4 and 7 are outside its vocabulary: q = 0 there
        return build_head(target, DraftSpec(family="head", feature_layers=(0, 1)), torch.tensor([0, 2, 3, 5, 6]))
    draft = tiny(seed=3, layers=2, **V8)
    if kind == "bad":
        with torch.no_grad():  # q is proportional to p ** -0.5: most siblings are rejected
            draft.lm_head.weight.mul_(-0.5)
        return draft
    return build_draft("truncate:1", target)


def _exact_first_two(target, prompt, sp):
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], sp)
        p2 = warp_probs(target(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1], sp)
    return p1[:, None] * p2


@pytest.mark.parametrize("kind, tree, sampling", [
    ("normal", "6,2,2", SamplingParams(temperature=1.0)),
    ("bad", "7,2,3", SamplingParams(temperature=1.0)),
    ("head", "6,2,2", SamplingParams(temperature=1.0)),
    ("normal", "5,2,3", SamplingParams(temperature=0.8, top_k=6, top_p=0.9)),
])
def test_sampled_tree_output_follows_the_targets_distribution(kind, tree, sampling, monkeypatch):
    """The first two tokens of a sampled tree decode, over many seeds, against p(t1) p(t2 | t1)
    (chi-square). max_new_tokens 3 makes the first step a depth-2 tree that covers both."""
    import serve.engine.step
    import serve.spec_decode.trees.dynamic

    steps, tries = [], []  # tries: per visited node, how many siblings were tried, and whether one was taken
    monkeypatch.setattr(serve.engine.step, "tree_verify", lambda *a: steps.append(1) or tree_verify(*a))
    real_try = serve.spec_decode.trees.dynamic._try_siblings

    def counted_try(children, *a):
        child, r = real_try(children, *a)
        tries.append((len(children) if child is None else children.index(child) + 1, child is not None))
        return child, r

    monkeypatch.setattr(serve.spec_decode.trees.dynamic, "_try_siblings", counted_try)
    target = tiny(seed=5, layers=2, **V8)
    eng = engine(target, _v8_draft(kind, target), tree, k=2)
    prompt = [1, 2, 3]
    counts = torch.zeros(8, 8, dtype=torch.long)
    for i in range(N_SAMPLES):
        sp = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=i)
        r = eng.generate(prompt, GenerationParams(max_new_tokens=3, sampling=sp, capture=False))
        counts[r.output_ids[0], r.output_ids[1]] += 1
    assert len(steps) >= N_SAMPLES  # every request decoded its first step as a tree
    # Each path of the rule ran many times: the first sibling taken, a later sibling taken
    # after a rejection, and every sibling rejected (the next token drawn from the residual).
    first = sum(1 for n, took in tries if took and n == 1)
    later = sum(1 for n, took in tries if took and n > 1)
    residual = sum(1 for _, took in tries if not took)
    assert min(first, later, residual) >= 10, (first, later, residual)
    assert chi2_pvalue(counts, _exact_first_two(target, prompt, sampling)) > 1e-3


def test_sampled_trees_are_reproducible_and_accept_more_than_a_chain_of_their_depth():
    target = tiny(**SMALL)
    draft = build_draft("truncate:2", target)
    prompt = [1, 2, 3, 4, 5, 6]

    def run(tree, seed):
        sp = SamplingParams(temperature=0.7, seed=seed)
        return engine(target, draft, tree).generate(prompt, GenerationParams(max_new_tokens=40, sampling=sp))

    assert run("8,3,3", 1).output_ids == run("8,3,3", 1).output_ids
    wide = [run("16,3,4", s).stats for s in range(6)]
    chain = [run("4,3,1", s).stats for s in range(6)]
    per_step = [sum(st.num_emitted_tokens for st in x) / sum(st.num_steps for st in x) for x in (wide, chain)]
    assert per_step[0] > per_step[1], per_step


@pytest.mark.parametrize("bad", ["1,1,1", "4,0,2", "a,b,c", "4,2"])
def test_bad_tree_shapes_are_refused(bad):
    with pytest.raises(EngineError, match="tree"):
        small_options(tree=bad)
    with pytest.raises(ValueError):
        TreeShape.parse(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("family", ["layer", "head"])
def test_tree_greedy_on_cuda_equals_the_targets(graphs, family):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    target = tiny(**SMALL).cuda()
    if family == "head":
        draft = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)),
                           torch.tensor([0, 2, 3, 5, 6, 8, 9], device="cuda"))
    else:
        draft = build_draft("truncate:2", target)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    eng = engine(target, draft, "16,4,4", cuda_graphs=graphs)
    want = SpecEngine(target, options=small_options(k=0, max_seq_len=96, cuda_graphs="off")).generate(
        prompt, GenerationParams(max_new_tokens=30)).output_ids
    assert eng.generate(prompt, GenerationParams(max_new_tokens=30)).output_ids == want


@pytest.mark.parametrize("tree", ["5,4,1", "8,3,2", "16,4,4"])
def test_head_tree_greedy_output_equals_the_targets(tree):
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    target = tiny(**SMALL)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.tensor([0, 2, 3, 5, 6, 8, 9]))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    got = engine(target, head, tree).generate(prompt, GenerationParams(max_new_tokens=30))
    assert got.output_ids == ar(target, prompt, 30)


def test_a_width_one_head_tree_is_the_head_chain():
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    target = tiny(**SMALL)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.arange(12))
    prompt = [1, 2, 3, 4, 5]
    chain = engine(target, head, "", k=3, k_policy="fixed").generate(prompt, GenerationParams(max_new_tokens=24))
    tree = engine(target, head, "4,3,1", k=3).generate(prompt, GenerationParams(max_new_tokens=24))
    assert tree.output_ids == chain.output_ids
    assert (tree.stats.num_steps, tree.stats.num_emitted_tokens) == (chain.stats.num_steps, chain.stats.num_emitted_tokens)


# ---------------------------------------------------------------- trees in the batch

def _tree_items_per_forward(monkeypatch):
    """How many draft trees each target forward of the engine's step carried."""
    import serve.engine.step

    seen, real = [], serve.engine.step.forward_batch
    monkeypatch.setattr(serve.engine.step, "forward_batch",
                        lambda r, items, *a, **kw: seen.append(sum(it.visible is not None for it in items))
                        or real(r, items, *a, **kw))
    return seen


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("family", ["layer", "head"])
def test_trees_ride_in_the_batch_and_each_request_gets_its_own_output(family, path, monkeypatch):
    """Several tree requests, a chain request (its processors rule a tree out), mixed prompt
    lengths and budgets, decoding together: several trees in one target forward beside the
    chain's rows and the prompt chunks, and each request's output is the one it gets alone
    (and the target's greedy decode). device: the GPU's step run on the CPU."""
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec
    from serve.sampling.processors import ProcessorParams

    target = tiny(**SMALL)
    draft = (build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.tensor([0, 2, 3, 5, 6, 8, 9]))
             if family == "head" else build_draft("truncate:2", target))
    eng = SpecEngine(target, draft, options=small_options(k=4, max_seq_len=96, max_concurrency=4, tree="8,3,2",
                                                          prefill_chunk=8))
    eng.gpu = path == "device"
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [2, 7], [5, 5, 6]]
    params = [GenerationParams(max_new_tokens=n) for n in (30, 18, 25)]
    params.append(GenerationParams(max_new_tokens=20, processors=ProcessorParams(logit_bias=((3, -1.0),))))
    alone = [eng.generate(p, gp).output_ids for p, gp in zip(prompts, params)]
    trees = _tree_items_per_forward(monkeypatch)
    got = stream_all(eng, prompts, params)
    assert [r.output_ids for r in got] == alone
    assert [r.output_ids for r in got[:3]] == [ar(target, p, gp.max_new_tokens) for p, gp in zip(prompts[:3], params)]
    assert max(trees) >= 2  # trees shared forwards
    assert max(n for _, n, _ in eng.scheduler.log.steps) >= 3
    assert eng.slots.free == 4


def test_sampled_trees_decoding_together_follow_the_targets_distribution():
    """The first two sampled tokens of tree requests run four at a time, over many seeds,
    against p(t1) p(t2 | t1) (chi-square); the same seeds in another grouping reproduce them."""
    target = tiny(seed=5, layers=2, **V8)
    eng = SpecEngine(target, _v8_draft("normal", target),
                     options=small_options(k=2, max_seq_len=96, max_concurrency=4, tree="6,2,2"))
    prompt = [1, 2, 3]
    sampling = SamplingParams(temperature=1.0)
    params = [GenerationParams(max_new_tokens=3, sampling=SamplingParams(1.0, seed=i), capture=False)
              for i in range(N_SAMPLES)]
    outs = []
    for lo in range(0, N_SAMPLES, 4):
        outs += [r.output_ids for r in stream_all(eng, [prompt] * 4, params[lo:lo + 4])]
    counts = torch.zeros(8, 8, dtype=torch.long)
    for o in outs:
        counts[o[0], o[1]] += 1
    assert chi2_pvalue(counts, _exact_first_two(target, prompt, sampling)) > 1e-3
    again = [r.output_ids for lo in (1, 4) for r in stream_all(eng, [prompt] * 3, params[lo:lo + 3])]
    assert again == outs[1:4] + outs[4:7]


def test_a_tree_request_cancelled_mid_batch_leaves_the_others_their_outputs(monkeypatch):
    """Two tree requests decode together; one is dropped by its consumer after a few steps. The
    other's output is still its own, and the dropped one's slot comes back."""
    import asyncio

    target = tiny(**SMALL)
    eng = SpecEngine(target, build_draft("truncate:2", target),
                     options=small_options(k=4, max_seq_len=96, max_concurrency=2, tree="8,3,2"))
    keep, drop = [1, 2, 3, 4, 5, 6, 7], [5, 5, 6, 2]
    want = eng.generate(keep, GenerationParams(max_new_tokens=40)).output_ids
    trees = _tree_items_per_forward(monkeypatch)

    async def kept():
        s = eng.stream(keep, GenerationParams(max_new_tokens=40))
        async for _ in s:
            pass
        return s.result.output_ids

    async def dropped():
        got = []
        async for toks in eng.stream(drop, GenerationParams(max_new_tokens=60)):
            got += toks
            if len(got) >= 6:
                break
        return got

    async def run():
        return await asyncio.gather(kept(), dropped())

    out, partial = asyncio.run(run())
    assert out == want and len(partial) >= 6
    assert max(trees) == 2  # they shared forwards before the drop
    assert eng.slots.free == 2
