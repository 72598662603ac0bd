"""The GPU's batched step (serve/model/pool_forward.py, batch_forward.pooled), run on the CPU
in CI and on a GPU where one is lent: every sequence's logits, features and cache equal its own
forward's, whatever rides beside it, with padding rows written only to the spare slot."""

import pytest
import torch

from infra.target import build_tiny_llama
from serve.model.batch_forward import Item, pooled
from serve.model.pool_forward import bucket, pool_rows
from serve.model.runner import LlamaRunner

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _runner(device: str, positions: int = 128) -> LlamaRunner:
    return LlamaRunner(build_tiny_llama(seed=5, num_layers=3, max_positions=positions, **SHAPE).to(device), positions)


def _filled(runner: LlamaRunner, n: int, contexts: list[int], gen: torch.Generator):
    caches = runner.new_caches(n)
    for c, m in zip(caches, contexts):
        if m:
            runner.forward(torch.randint(0, 300, (m,), generator=gen).to(runner.device), c)
    return caches


@pytest.mark.parametrize("device", DEVICES)
def test_each_sequence_gets_its_own_forward(device):
    """Decode rows, verify blocks, a first row on an empty cache, a prompt chunk (alone) and a
    slot left idle between them."""
    runner = _runner(device)
    gen = torch.Generator().manual_seed(0)
    contexts = [9, 40, 4, 0, 13, 6, 3]
    spec = [(0, 1, True), (1, 5, True), (2, 3, True), (3, 1, True), (4, 24, False), (6, 5, True)]  # slot 5 idle
    caches = _filled(runner, len(contexts), contexts, gen)
    refs = [runner.new_cache() for _ in spec]
    for (slot, _, _), ref in zip(spec, refs):
        c = caches[slot]
        ref.k.copy_(c.k)
        ref.v.copy_(c.v)
        ref.length = c.length
    spare_k = caches[0].pool.k[:, caches[0].pool.spare].clone()
    idle_k = caches[5].k.clone()
    toks = [torch.randint(0, 300, (t,), generator=gen).to(device) for _, t, _ in spec]
    layers = (0, 2)
    out = pooled(runner, [Item(t, caches[s], lg) for t, (s, _, lg) in zip(toks, spec)], layers)
    for t, (slot, _, lg), ref, (logits, feats) in zip(toks, spec, refs, out):
        c = caches[slot]
        want_logits, want_feats = runner.forward_features(t, ref, layers)
        assert c.length == ref.length
        torch.testing.assert_close(feats, want_feats, rtol=1e-4, atol=1e-4)
        if lg:
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        n = c.length
        torch.testing.assert_close(c.k[:, :, :n], ref.k[:, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.v[:, :, :n], ref.v[:, :, :n], rtol=1e-4, atol=1e-4)
    assert torch.equal(caches[5].k, idle_k)
    # 1+5+3+1+5 = 15 rows padded to 16: one padding row, written to the spare slot only
    assert not torch.equal(caches[0].pool.k[:, caches[0].pool.spare], spare_k)


def test_rows_are_bucketed_and_padding_goes_to_the_spare_slot():
    runner = _runner("cpu", 1024)
    caches = _filled(runner, 3, [10, 295, 0], torch.Generator().manual_seed(2))
    toks = [torch.tensor([5]), torch.tensor([2, 3, 4]), torch.tensor([1])]
    spare = caches[0].pool.spare
    rows = pool_rows(caches[0].pool, toks, caches[::-1], runner.device)
    # 5 rows -> 8; 3 sequences and a padding line -> 4 lines; longest 3 -> 4; furthest end 298 -> 512
    assert rows.key == (8, 4, 4, 512)
    assert rows.n == 5
    assert rows.slot.tolist() == [2, 1, 1, 1, 0] + [spare] * 3
    assert rows.pos.tolist()[:5] == [0, 295, 296, 297, 10]
    assert rows.line.tolist() == [0, 1, 1, 1, 2, 3, 3, 3]
    assert rows.col.tolist() == [0, 0, 1, 2, 0, 0, 0, 0]
    assert rows.line_slot.tolist() == [2, 1, 0, spare]
    short = pool_rows(caches[0].pool, toks[:1], caches[:1], runner.device)
    assert short.key == (1, 1, 1, 256)  # no padding, no padding line; never under MIN_SPAN
    decodes = pool_rows(caches[0].pool, [toks[0], toks[2], toks[0]], caches, runner.device)
    assert decodes.key == (4, 4, 1, 512)  # one row each: a line a row, padding included
    assert decodes.line.tolist() == [0, 1, 2, 3] and decodes.line_slot.tolist() == [0, 1, 2, spare]
    assert [bucket(n) for n in (1, 2, 3, 17, 64)] == [1, 2, 4, 32, 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_the_eager_pool_forward():
    """The CUDA-graph runner replays a graph per bucket: its logits equal the eager pool
    forward's on copies of the same caches, across steps that reuse a captured bucket."""
    from serve.model.cuda_graphs import GraphLlamaRunner

    model = build_tiny_llama(seed=5, num_layers=3, max_positions=128, **SHAPE).to("cuda")
    eager, graphs = LlamaRunner(model, 128), GraphLlamaRunner(model, 128)
    gen = torch.Generator().manual_seed(4)
    ce, cg = _filled(eager, 4, [5, 9, 0, 30], gen), graphs.new_caches(4)
    cg[0].pool.k.copy_(ce[0].pool.k)
    cg[0].pool.v.copy_(ce[0].pool.v)
    for a, b in zip(ce, cg):
        b.length = a.length
    for step in range(3):
        toks = [torch.randint(0, 300, (t,), generator=gen).cuda() for t in (1, 5, 1, 3)]
        want = pooled(eager, [Item(t, c) for t, c in zip(toks, ce)])
        got = pooled(graphs, [Item(t, c) for t, c in zip(toks, cg)])
        for (lw, _), (lg, _) in zip(want, got):
            torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)
    assert any(key[1] == "pool" for key in graphs.graphs.graphs)
