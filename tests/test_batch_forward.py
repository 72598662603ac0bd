"""The batched forward (serve/model/batch_forward.py): rows of several sequences in one forward give
each sequence the logits, features and cache of its own forward, to rounding."""

import pytest
import torch

from infra.target import build_tiny_llama
from serve.model.batch_forward import Item, forward_batch
from serve.model.linear import dequantize_int4, int4_codes
from serve.model.runner import LlamaRunner

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

SHAPE = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def tiny(dtype="float32", on_int4_grid=False):
    """on_int4_grid: decoder weights that int4 holds exactly, so an int4 runner's wide steps (the
    model's own bfloat16 weights) and narrow ones (int4) compute the same model."""
    model = build_tiny_llama(seed=3, num_layers=3, max_positions=128, dtype=dtype, **SHAPE)
    if on_int4_grid:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("model.layers.") and p.dim() == 2:
                    p.copy_(dequantize_int4(*int4_codes(p)).to(p.dtype))
    return model


def _seqs(gen):
    """(context, new rows, wants logits): decodes, a verify block, a prompt chunk, an empty cache."""
    spec = [(9, 1, True), (20, 1, True), (4, 5, True), (0, 24, False), (13, 1, True), (0, 3, True)]
    return [(torch.randint(0, 300, (c,), generator=gen), torch.randint(0, 300, (t,), generator=gen), lg)
            for c, t, lg in spec]


@pytest.mark.parametrize("quant,dtype,tol,upcast", [("none", "float32", 1e-4, False), ("none", "bfloat16", 2e-2, False),
                                                    ("int4", "bfloat16", 3e-2, False), ("none", "bfloat16", 2e-2, True),
                                                    ("int4", "bfloat16", 3e-2, True)])
def test_batched_rows_equal_each_sequence_alone(quant, dtype, tol, upcast):
    """int4: this batch is wide, so it runs the bfloat16 weights and the bfloat16 head where
    alone a sequence runs int4 and int8: the same model, up to the int8 head's rounding.
    upcast: the wide weights in float32, as on a CPU without native bfloat16 GEMMs."""
    runner = LlamaRunner(tiny(dtype, on_int4_grid=quant == "int4"), 128, quant, wide_upcast=upcast)
    seqs = _seqs(torch.Generator().manual_seed(0))
    layers = (0, 2)
    pooled = runner.new_caches(len(seqs))
    for (ctx, _, _), cache in zip(seqs, pooled):
        if ctx.numel():
            runner.forward(ctx, cache)
    out = forward_batch(runner, [Item(new, c, lg) for (_, new, lg), c in zip(seqs, pooled)], layers)
    for (ctx, new, lg), c, (logits, feats) in zip(seqs, pooled, out):
        alone = runner.new_cache()
        if ctx.numel():
            runner.forward(ctx, alone)
        want_logits, want_feats = runner.forward_features(new, alone, layers)
        assert c.length == alone.length == ctx.numel() + new.numel()
        torch.testing.assert_close(feats.float(), want_feats.float(), rtol=tol, atol=tol)
        if lg and quant == "int4":
            assert (logits - want_logits).abs().max() <= 0.05 * want_logits.abs().max()
        elif lg:
            torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol)
        else:
            assert logits is None
        n = c.length
        torch.testing.assert_close(c.k[:, :, :n].float(), alone.k[:, :, :n].float(), rtol=tol, atol=tol)


def test_one_row_sequences_in_a_pool_attend_only_to_their_own_cache():
    """Slots between the batch's sequences hold other data; the mask keeps it out."""
    runner = LlamaRunner(tiny(), 128)
    caches = runner.new_caches(4)
    gen = torch.Generator().manual_seed(1)
    for c, n in zip(caches, (7, 30, 2, 11)):
        runner.forward(torch.randint(0, 300, (n,), generator=gen), c)
    toks = [torch.randint(0, 300, (1,), generator=gen) for _ in range(2)]
    got = forward_batch(runner, [Item(toks[0], caches[0]), Item(toks[1], caches[2])])
    for tok, c, (logits, _) in zip(toks, (caches[0], caches[2]), got):
        ref = runner.new_cache()
        ref.k.copy_(c.k)
        ref.v.copy_(c.v)
        ref.length = c.length - 1
        torch.testing.assert_close(logits, runner.forward(tok, ref), rtol=1e-5, atol=1e-5)


def test_a_sequence_that_would_overflow_its_cache_fails_the_forward_before_any_write():
    runner = LlamaRunner(build_tiny_llama(seed=0, max_positions=16, **SHAPE), 16)
    caches = runner.new_caches(2)
    runner.forward(torch.arange(15), caches[0])
    with pytest.raises(ValueError, match="exceeds"):
        forward_batch(runner, [Item(torch.arange(3), caches[0]), Item(torch.arange(1), caches[1])])
    assert caches[0].length == 15 and caches[1].length == 0


def test_a_growing_pool_keeps_what_its_slots_hold(monkeypatch):
    """A pool's positions double as a sequence needs them; every slot's cache is carried over,
    and a batched step over the grown pool still equals each sequence alone."""
    from serve.model.runner import KVPool

    monkeypatch.setattr(KVPool, "MIN_CAPACITY", 8)
    runner = LlamaRunner(tiny(), 128)
    caches = runner.new_caches(3, growable=True)
    assert caches[0].pool.capacity == 8
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (6, 41, 3)]
    for p, c in zip(prompts, caches):
        runner.forward(p, c)  # the 41-token prompt grows the pool to 64, under the others
    assert caches[0].pool.capacity == 64 and all(c.k.shape[2] == 64 for c in caches)
    toks = [torch.randint(0, 300, (1,), generator=gen) for _ in caches]
    got = forward_batch(runner, [Item(t, c) for t, c in zip(toks, caches)])
    for p, t, (logits, _) in zip(prompts, toks, got):
        alone = runner.new_cache()
        runner.forward(p, alone)
        torch.testing.assert_close(logits, runner.forward(t, alone), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="exceeds"):
        caches[1].reserve(129)


def test_wide_weights_are_float32_only_where_bfloat16_gemms_are_not_native(monkeypatch):
    import serve.model.runner
    from serve.model.linear import Dense, Int4, Upcast

    model = tiny("bfloat16", on_int4_grid=True)
    forced = LlamaRunner(model, 128, "int4", wide_upcast=True)
    qkv = forced.prefill_blocks[0][1]
    assert isinstance(qkv, Upcast) and qkv.weight.dtype == torch.float32 and isinstance(forced.blocks[0][1], Int4)
    assert isinstance(forced.wide_head, Upcast)
    x = torch.randn(30, 64, dtype=torch.bfloat16)
    got = qkv(x)
    assert got.dtype == torch.bfloat16  # the activations keep their dtype
    torch.testing.assert_close(got.float(), x.float() @ qkv.weight.t(), rtol=1e-2, atol=1e-2)
    # Decided by the CPU: float32 copies only for a lower-precision model where bfloat16 is emulated.
    monkeypatch.setattr(serve.model.runner, "native_bf16_gemm", lambda: False)
    assert isinstance(LlamaRunner(model, 128, "int4").prefill_blocks[0][1], Upcast)
    f32 = LlamaRunner(tiny("float32"), 128, "none")
    assert f32.prefill_blocks is f32.blocks and isinstance(f32.blocks[0][1], Dense)
    monkeypatch.setattr(serve.model.runner, "native_bf16_gemm", lambda: True)
    native = LlamaRunner(model, 128, "int4")
    assert isinstance(native.prefill_blocks[0][1], Dense) and native.prefill_blocks[0][1].weight.dtype == torch.bfloat16
