"""The head draft on the native kernels (serve/spec_decode/head/native.py): close to LeanHead's
int8 rows, a row's result independent of the rows beside it and of how a sequence's rows are
split into calls, every build giving the scalar build's bits, lossless drafting beside the
native int4 target, and the fallbacks and refusals saying why."""

import pytest
import torch

from engine_options import small_options
from infra.drafts.head import build_head
from infra.drafts.spec import DraftSpec
from infra.target import build_tiny_llama
from native_builds import BUILDS, VARIANTS, load_build
from serve.engine.core import GenerationParams, SpecEngine
from serve.model.native_build import NativeUnavailable
from serve.model.runner import StaticKVCache
from serve.spec_decode.head.draft import HeadRunner, head_kernel
from serve.spec_decode.head.lean import LeanHead
from serve.spec_decode.head.native import NativeHead

pytestmark = [pytest.mark.pure]

needs_native = pytest.mark.skipif(not VARIANTS, reason="this CPU runs no native variant")
# Widths the kernels tile (multiples of 32; head_dim 32), grouped-query attention, a draft
# vocabulary that is not a multiple of 16 (the padded tile of its LM head).
SHAPE = dict(vocab_size=304, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
VOCAB = torch.arange(0, 300, 2)  # 150 draft tokens


def tiny_head(seed=0, vocab=VOCAB, **shape):
    model = build_tiny_llama(seed=seed, num_layers=3, max_positions=160, dtype="bfloat16", **{**SHAPE, **shape})
    model.config.eos_token_id = None
    head = build_head(model, DraftSpec(family="head", feature_layers=(0, 2)), vocab)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a trained head's weights are not the target's copies
    return model, head


def cache(head):
    return StaticKVCache(1, head.n_kv, 160, head.head_dim, torch.bfloat16, "cpu")


def inputs(head, t, seed=1):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(t, head.embed.shape[1], generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, head.vocab_size, (t,), generator=gen)
    return g, ids


def run(kernel, head, g, ids, c, split=None):
    """Rows of one sequence in calls of `split` rows (all at once by default): every call's
    (last logits, last state), the cache's length moved as HeadRunner moves it."""
    out, step = [], split or ids.shape[0]
    for a in range(0, ids.shape[0], step):
        b = min(a + step, ids.shape[0])
        mask = torch.ones(b - a, b, dtype=torch.bool).tril(a) if b - a > 1 else None
        out.append(kernel.rows(g[a:b], ids[a:b], c, c.length, mask))
        c.length = b
    return out


@needs_native
def test_native_rows_follow_leanheads_int8_rows_to_rounding():
    _, head = tiny_head()
    g, ids = inputs(head, 12)
    lean, native = LeanHead(head, "int8"), NativeHead(head)
    want = run(lean, head, g, ids, cache(head), split=1)
    got = run(native, head, g, ids, cache(head), split=1)
    agree = 0
    for (lw, sw), (lg, sg) in zip(want, got):
        assert lg.shape == lw.shape == (VOCAB.numel(),) and lg.dtype == torch.float32
        assert sg.shape == sw.shape and sg.dtype == sw.dtype
        assert (lg - lw).norm() / lw.norm() < 0.05
        assert (sg.float() - sw.float()).norm() / sw.float().norm() < 0.05
        agree += int(lg.argmax() == lw.argmax())
    assert agree >= 10
    feats = torch.randn(5, 2 * head.embed.shape[1]).to(torch.bfloat16)
    fl, fn = lean.fuse(feats), native.fuse(feats)
    assert fn.dtype == fl.dtype and (fn.float() - fl.float()).norm() / fl.float().norm() < 0.05


@needs_native
def test_a_block_of_rows_equals_the_same_rows_one_call_at_a_time_bit_for_bit():
    _, head = tiny_head(seed=3)
    native = NativeHead(head)
    g, ids = inputs(head, 9)
    whole, single = cache(head), cache(head)
    (logits, state), = run(native, head, g, ids, whole)
    steps = run(native, head, g, ids, single, split=1)
    assert torch.equal(logits, steps[-1][0]) and torch.equal(state, steps[-1][1])
    assert torch.equal(whole.k[:, :, :9], single.k[:, :, :9]) and torch.equal(whole.v[:, :, :9], single.v[:, :, :9])


@needs_native
def test_a_batch_of_sequences_equals_each_sequence_alone():
    _, head = tiny_head(seed=4)
    native = NativeHead(head)
    (g1, i1), (g2, i2) = inputs(head, 3, seed=5), inputs(head, 1, seed=6)
    alone = [run(native, head, g, i, cache(head))[0] for g, i in ((g1, i1), (g2, i2))]
    c1, c2 = cache(head), cache(head)
    logits, states = native.rows_batch([g1, g2], [i1, i2], [c1, c2], [None, None])
    assert logits.shape == (2, VOCAB.numel()) and states.shape == (2, head.embed.shape[1])
    for row, (lw, sw) in enumerate(alone):
        assert torch.equal(logits[row], lw) and torch.equal(states[row:row + 1], sw)


@needs_native
@pytest.mark.parametrize("variant", BUILDS)
def test_every_build_gives_the_scalar_builds_bits(variant):
    _, head = tiny_head(seed=7)
    g, ids = inputs(head, 6)
    ref = run(NativeHead(head, load_build("scalar")), head, g, ids, cache(head), split=4)
    got = run(NativeHead(head, load_build(variant)), head, g, ids, cache(head), split=4)
    for (lw, sw), (lg, sg) in zip(ref, got):
        assert torch.equal(lg, lw) and torch.equal(sg, sw)


@needs_native
@pytest.mark.parametrize("draft_tokens", [VOCAB, torch.arange(0, 304)])
def test_a_native_head_drafts_for_the_native_int4_target_losslessly(draft_tokens):
    model, head = tiny_head(seed=8, vocab=draft_tokens)
    opts = dict(k=3, max_seq_len=160, quant="int4", k_policy="fixed")
    ar = SpecEngine(model, options=small_options(**opts))
    sd = SpecEngine(model, head, options=small_options(**opts))
    assert isinstance(sd.draft.kernel, NativeHead)
    gen = torch.Generator().manual_seed(9)
    drafted = 0
    for _ in range(3):
        prompt = torch.randint(0, 304, (9,), generator=gen).tolist()
        params = GenerationParams(max_new_tokens=30)
        out = sd.generate(prompt, params)
        assert out.output_ids == ar.generate(prompt, params).output_ids
        drafted += out.stats.num_draft_tokens
    assert drafted > 0


@needs_native
def test_torch_kernels_on_request_and_without_an_int4_target():
    _, head = tiny_head()
    assert isinstance(head_kernel(head, "int4"), NativeHead)
    assert isinstance(head_kernel(head, "int4", "torch"), LeanHead)
    assert isinstance(head_kernel(head, "none"), LeanHead)
    assert isinstance(HeadRunner(head, 160, "int4", "torch").kernel, LeanHead)


@needs_native
def test_a_head_the_tiles_do_not_fit_falls_back_or_is_refused_saying_why(caplog):
    _, head = tiny_head(hidden_size=80, num_heads=4, num_kv_heads=2, intermediate_size=160)  # head_dim 20
    with pytest.raises(NativeUnavailable, match="head_dim 20"):
        NativeHead(head)
    with caplog.at_level("WARNING"):
        assert isinstance(head_kernel(head, "int4"), LeanHead)
    assert "head_dim 20" in caplog.text
    with pytest.raises(ValueError, match="head_dim 20"):
        head_kernel(head, "int4", "native")


def test_a_library_without_the_head_forward_is_refused():
    class Old:  # an older build: it has the target's forward only
        osd_forward = None

    _, head = tiny_head()
    with pytest.raises(NativeUnavailable, match="no head forward"):
        NativeHead(head, lib=Old())


@needs_native
def test_bad_input_is_refused_before_anything_is_written():
    _, head = tiny_head()
    native = NativeHead(head)
    c = cache(head)
    run(native, head, *inputs(head, 4), c)
    k, v = c.k.clone(), c.v.clone()
    g, ids = inputs(head, 2)
    with pytest.raises(ValueError, match="token or position out of range"):
        native.rows(g, torch.tensor([1, head.vocab_size]), c, c.length, None)
    c.length = 159
    with pytest.raises(ValueError, match="exceeds the head cache's 160"):
        native.rows(g, ids, c, c.length, None)  # the second row would sit past the cache
    c.length = 4
    with pytest.raises(ValueError, match="at the cache's length"):
        native.rows(g, ids, c, 3, None)
    assert torch.equal(c.k, k) and torch.equal(c.v, v)
    with pytest.raises(ValueError, match="bfloat16 caches"):
        native.rows(g, ids, StaticKVCache(1, head.n_kv, 160, head.head_dim, torch.float32, "cpu"), 0, None)

