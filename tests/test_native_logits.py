"""The step's native reads of its logit rows (serve/model/native/logits.h): each row's argmax
and its top-k log-probabilities equal PyTorch's, on every variant this CPU runs; rows PyTorch
must read (NaN, +inf, other dtypes, k out of range) are refused; and an engine gives the same
tokens and records with them as without."""

import ctypes

import pytest
import torch

from engine_options import small_options
from infra.records.tokens import topk_logprobs
from infra.target import build_tiny_llama
from serve.engine.core import GenerationParams, SpecEngine
from serve.model import native_build, native_logits
from serve.sampling.verify import SamplingParams
from serve.spec_decode.specs import build_draft

pytestmark = [pytest.mark.pure]

VARIANTS = native_build.supported()
needs_native = pytest.mark.skipif(not VARIANTS, reason="this CPU runs no native variant")


def stats(lib: ctypes.CDLL, x: torch.Tensor, k: int):
    rows = x.shape[0]
    amax, ids, lps = torch.empty(rows, dtype=torch.long), torch.empty(rows, k, dtype=torch.long), torch.empty(rows, k)
    err = lib.osd_logit_stats(x.data_ptr(), rows, x.shape[1], k, amax.data_ptr(), ids.data_ptr(), lps.data_ptr(), 2)
    return None if err else (amax, ids, lps)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("vocab,k", [(49152, 8), (300, 5), (17, 17), (1000, 64), (304, 0), (7, 1)])
def test_argmax_and_topk_equal_pytorchs(variant, vocab, k):
    lib = native_build.load_variant(variant)
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    x[3, : vocab // 2] = float("-inf")  # masked entries (a processor's) are ordinary values here
    amax, ids, lps = stats(lib, x, k)
    assert torch.equal(amax, x.argmax(-1))
    if k:
        ref_ids, ref_lps = topk_logprobs(x, k)
        assert torch.equal(x.gather(1, ids), x.gather(1, ref_ids))  # the same values, in order
        finite = ref_lps.isfinite().all(-1)  # among equal -inf entries PyTorch's order is its own
        assert finite.sum() >= 8 and torch.equal(ids[finite], ref_ids[finite])
        torch.testing.assert_close(lps, ref_lps, rtol=0, atol=2e-5)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_ties_go_to_the_lower_id(variant):
    lib = native_build.load_variant(variant)
    x = torch.zeros(2, 40)
    x[0, [5, 21, 33]] = 2.0  # three equal maxima, then equal runners-up
    x[1, :] = -1.0
    amax, ids, lps = stats(lib, x, 4)
    assert amax.tolist() == [5, 0] == x.argmax(-1).tolist()
    assert ids.tolist() == [[5, 21, 33, 0], [0, 1, 2, 3]]
    assert torch.equal(lps[1], torch.full((4,), -torch.log(torch.tensor(40.0))))


@needs_native
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_rows_pytorch_must_read_are_refused(bad):
    x = torch.randn(3, 64)
    x[1, 7] = float(bad)
    assert native_logits.logit_stats(x, 4) is None
    assert native_logits.logit_stats(x[[0, 2]], 4) is not None


@needs_native
def test_arguments_out_of_range_are_refused():
    x = torch.randn(2, 64)
    assert native_logits.logit_stats(x, 65) is None  # more than the vocabulary
    assert native_logits.logit_stats(torch.randn(2, 100), native_logits.MAX_TOP_K + 1) is None
    assert native_logits.logit_stats(x, -1) is None
    assert native_logits.logit_stats(x.to(torch.bfloat16), 4) is None
    assert native_logits.logit_stats(x[0], 4) is None  # one row must still be [1, V]
    amax, ids, lps = native_logits.logit_stats(x[:, ::2], 3)  # strided: read as a contiguous copy
    assert torch.equal(amax, x[:, ::2].argmax(-1)) and ids.shape == (2, 3)


def test_switched_off_pytorch_reads_them(monkeypatch):
    monkeypatch.setenv("OSD_NATIVE_LOGITS", "off")
    native_logits._lib.cache_clear()
    try:
        assert not native_logits.available() and native_logits.logit_stats(torch.randn(2, 64), 4) is None
    finally:
        monkeypatch.delenv("OSD_NATIVE_LOGITS")
        native_logits._lib.cache_clear()


def _run(monkeypatch, native: bool, draft: str, sampled: bool):
    monkeypatch.setenv("OSD_NATIVE_LOGITS", "on" if native else "off")
    native_logits._lib.cache_clear()
    model = build_tiny_llama(seed=3, num_layers=2, vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, max_positions=128)
    model.config.eos_token_id = None
    eng = SpecEngine(model, build_draft(draft, model), options=small_options(k=3, k_policy="fixed", capture_top_k=6))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (6,), generator=gen).tolist() * 2 for _ in range(3)]
    params = GenerationParams(max_new_tokens=16, capture=True,
                              sampling=SamplingParams(temperature=0.8 if sampled else 0.0, seed=11))
    return eng.generate_many(prompts, params)


@needs_native
@pytest.mark.parametrize("draft,sampled", [("suffix", False), ("truncate:1", False), ("suffix", True)])
def test_an_engine_gives_the_same_tokens_and_records_with_and_without_them(monkeypatch, draft, sampled):
    try:
        on, off = _run(monkeypatch, True, draft, sampled), _run(monkeypatch, False, draft, sampled)
    finally:
        native_logits._lib.cache_clear()
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert sum(r.stats.num_draft_tokens for r in on) > 0
    for a, b in zip(on, off):
        assert (a.capture.topk_ids == b.capture.topk_ids).all()
        assert abs(a.capture.topk_logprobs - b.capture.topk_logprobs).max() < 2e-5


def test_a_steps_rows_are_read_in_place_where_they_lie_back_to_back():
    from serve.engine.step import _joined

    out = torch.randn(7, 50)
    parts = list(out.split([2, 4, 1]))  # a batched forward's logits, item after item
    joined = _joined(parts)
    assert joined.data_ptr() == out.data_ptr() and torch.equal(joined, out)
    apart = [out[:2], out[3:5]]  # a row between them: copied
    assert torch.equal(_joined(apart), torch.cat(apart)) and _joined(apart).data_ptr() != out.data_ptr()
    assert torch.equal(_joined([out[4:], out[:2]]), torch.cat([out[4:], out[:2]]))  # out of order
    assert torch.equal(_joined([out[:3]]), out[:3])
