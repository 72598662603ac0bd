"""Tree steps in the engine (serve/tree_stages.py) on tiny random Llamas: greedy output equals
the target's, a width-1 tree is the chain, and the compacted cache is the cache of decoding
the accepted tokens directly."""

import pytest
import torch

from infra.target import build_tiny_llama
from serve.drafts import build_draft
from serve.engine import EngineError, EngineOptions, GenerationParams, SpecEngine
from serve.tree_stages import TreeShape
from serve.verify import SamplingParams

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

SMALL = dict(vocab_size=12, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def tiny(seed=0, layers=3, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=96, **kw)
    m.config.eos_token_id = None
    return m


def engine(target, draft, tree, k=4, **kw):
    return SpecEngine(target, draft, options=EngineOptions(k=k, max_seq_len=96, max_concurrency=1, tree=tree, **kw))


def ar(target, prompt, n):
    return SpecEngine(target, options=EngineOptions(k=0, max_seq_len=96)).generate(
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
    chain = engine(target, draft, "", k=3, adaptive_k=False).generate(prompt, GenerationParams(max_new_tokens=24))
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


def test_sampling_requests_fall_back_to_chains():
    target = tiny(**SMALL)
    eng = engine(target, build_draft("truncate:2", target), "8,3,2")
    r = eng.generate([1, 2, 3], GenerationParams(max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=0)))
    assert len(r.output_ids) == 10 and r.stats.num_draft_tokens > 0


@pytest.mark.parametrize("bad", ["1,1,1", "4,0,2", "a,b,c", "4,2"])
def test_bad_tree_shapes_are_refused(bad):
    with pytest.raises(EngineError, match="tree"):
        EngineOptions(tree=bad)
    with pytest.raises(ValueError):
        TreeShape.parse(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graphs", ["off", "on"])
@pytest.mark.parametrize("family", ["layer", "head"])
def test_tree_greedy_on_cuda_equals_the_targets(graphs, family):
    from infra.draft_head import build_head
    from infra.draft_spec import DraftSpec

    target = tiny(**SMALL).cuda()
    if family == "head":
        draft = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)),
                           torch.tensor([0, 2, 3, 5, 6, 8, 9], device="cuda"))
    else:
        draft = build_draft("truncate:2", target)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    eng = engine(target, draft, "16,4,4", cuda_graphs=graphs)
    want = SpecEngine(target, options=EngineOptions(k=0, max_seq_len=96, cuda_graphs="off")).generate(
        prompt, GenerationParams(max_new_tokens=30)).output_ids
    assert eng.generate(prompt, GenerationParams(max_new_tokens=30)).output_ids == want


@pytest.mark.parametrize("tree", ["5,4,1", "8,3,2", "16,4,4"])
def test_head_tree_greedy_output_equals_the_targets(tree):
    from infra.draft_head import build_head
    from infra.draft_spec import DraftSpec

    target = tiny(**SMALL)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.tensor([0, 2, 3, 5, 6, 8, 9]))
    prompt = [1, 2, 3, 4, 5, 6, 7]
    got = engine(target, head, tree).generate(prompt, GenerationParams(max_new_tokens=30))
    assert got.output_ids == ar(target, prompt, 30)


def test_a_width_one_head_tree_is_the_head_chain():
    from infra.draft_head import build_head
    from infra.draft_spec import DraftSpec

    target = tiny(**SMALL)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.arange(12))
    prompt = [1, 2, 3, 4, 5]
    chain = engine(target, head, "", k=3, adaptive_k=False).generate(prompt, GenerationParams(max_new_tokens=24))
    tree = engine(target, head, "4,3,1", k=3).generate(prompt, GenerationParams(max_new_tokens=24))
    assert tree.output_ids == chain.output_ids
    assert (tree.stats.num_steps, tree.stats.num_emitted_tokens) == (chain.stats.num_steps, chain.stats.num_emitted_tokens)
