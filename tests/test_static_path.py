"""The GPU path's pieces, run on CPU: the fixed-shape forward (serve/model/runner.py
forward_static) and the engine's step as a GPU takes it (the pool forward, one host read of
the greedy requests' tokens a step: serve/engine/step.py), for a request alone. CUDA graphs
themselves only replay on a GPU: those tests are marked `cuda` and skipped without one.
"""

import pytest
import torch

from chi2 import chi2_pvalue
from infra.drafts.head import build_head
from infra.drafts.spec import DraftSpec
from infra.target import build_tiny_llama
from serve.spec_decode.specs import build_draft
from serve.engine.core import EngineError, GenerationParams, SpecEngine
from engine_options import small_options
from serve.model.runner import LlamaRunner
from serve.sampling.verify import SamplingParams

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def tiny(seed=0, layers=2, **kw):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=kw.pop("max_positions", 64), **kw)
    m.config.eos_token_id = None
    return m


def test_static_forward_equals_the_eager_forward_step_by_step():
    """Prefill eagerly, then decode and verify-sized blocks through forward_static into one
    cache and eager forwards into another: logits, features and the live cache rows agree."""
    r = LlamaRunner(tiny(), 64)
    eager, static = r.new_cache(), r.new_cache()
    ids = torch.tensor([5, 17, 200, 3, 99, 45, 7, 8, 9, 10, 11, 12])
    r.forward(ids[:4], eager)
    r.forward(ids[:4], static)
    at = 4
    for t in (1, 3, 1, 2):
        block = ids[at: at + t]
        want, want_f = r.forward_features(block, eager, (0, 1))
        got, got_f = r.forward_static(block, torch.tensor([at]), static, (0, 1))
        static.length = at + t
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_f, want_f, rtol=1e-4, atol=1e-4)
        at += t
    torch.testing.assert_close(static.k[:, :, :at], eager.k[:, :, :at])


def test_static_forward_ignores_stale_rows_past_the_sequence():
    """A rejected draft leaves K/V rows past the committed length; the mask must hide them."""
    r = LlamaRunner(tiny(), 64)
    clean, dirty = r.new_cache(), r.new_cache()
    ids = torch.tensor([5, 17, 200, 3, 99])
    r.forward(ids, clean)
    r.forward(ids, dirty)
    r.forward_static(torch.tensor([1, 2, 3]), torch.tensor([5]), dirty)  # then rolled back
    want, _ = r.forward_static(torch.tensor([42]), torch.tensor([5]), clean)
    got, _ = r.forward_static(torch.tensor([42]), torch.tensor([5]), dirty)
    torch.testing.assert_close(got, want)


def test_head_static_rows_equal_the_eager_rows():
    from serve.spec_decode.head.draft import HeadRunner

    target = tiny(layers=3)
    head = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.arange(200))
    r = HeadRunner(head, 64)
    eager, static = r.new_cache(), r.new_cache()
    g = torch.randn(6, target.config.hidden_size)
    nxt = torch.tensor([5, 17, 200, 3, 99, 45])
    at = 0
    for t in (3, 1, 2):
        want = r.rows(g[at: at + t], nxt[at: at + t], eager)
        got = r.rows_static(static, g[at: at + t], nxt[at: at + t], torch.tensor([at]))
        static.length = at + t
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        at += t


def _device_path(engine: SpecEngine) -> SpecEngine:
    engine.gpu = True  # the GPU's step; on CPU it runs the same tensor code
    return engine


@pytest.mark.parametrize("k", [1, 2, 4])
def test_device_stages_give_the_cpu_stages_tokens_and_stats(k):
    target = tiny()
    draft = build_draft("truncate:1", target)
    prompt = [17, 200, 3, 99, 45]
    cpu = SpecEngine(target, draft, options=small_options(k=k, max_seq_len=64, max_concurrency=1))
    dev = _device_path(SpecEngine(target, draft, options=small_options(k=k, max_seq_len=64, max_concurrency=1)))
    a = cpu.generate(prompt, GenerationParams(max_new_tokens=24))
    b = dev.generate(prompt, GenerationParams(max_new_tokens=24))
    assert b.output_ids == a.output_ids
    assert (b.stats.num_steps, b.stats.num_accepted_tokens) == (a.stats.num_steps, a.stats.num_accepted_tokens)
    assert b.stats.stage_s["score"] > 0 and b.stats.stage_s["commit"] > 0
    assert b.capture.draft_tokens.tolist() == a.capture.draft_tokens.tolist()
    torch.testing.assert_close(torch.from_numpy(b.capture.draft_probs), torch.from_numpy(a.capture.draft_probs),
                               equal_nan=True)


def test_device_stages_with_a_head_draft_equal_target_greedy():
    target = tiny(layers=3)
    spec = DraftSpec(family="head", feature_layers=(0, 1, 2))
    head = build_head(target, spec, torch.arange(200))
    prompt = [17, 200, 3, 99, 45, 8, 9]
    ar = SpecEngine(target, options=small_options(k=0, max_seq_len=64)).generate(prompt, GenerationParams(max_new_tokens=20))
    for k in (1, 3):
        eng = _device_path(SpecEngine(target, head, options=small_options(k=k, max_seq_len=64)))
        assert eng.generate(prompt, GenerationParams(max_new_tokens=20)).output_ids == ar.output_ids


def test_device_stages_sample_the_targets_distribution():
    """Chi-square on the first two sampled tokens over a tiny vocab: the device-path
    proposal (multinomial on the device) with the exact rejection rule stays lossless."""
    kw = dict(vocab_size=6, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=16)
    target, draft = tiny(seed=1, **kw), tiny(seed=2, layers=1, **kw)
    eng = _device_path(SpecEngine(target, draft, options=small_options(k=2, max_seq_len=16, capture=False)))
    prompt = [1, 2, 3]
    sp = lambda s: GenerationParams(max_new_tokens=2, sampling=SamplingParams(temperature=1.0, seed=s), capture=False)
    counts = torch.zeros(36)
    for s in range(3000):
        out = eng.generate(prompt, sp(s)).output_ids
        counts[out[0] * 6 + out[1]] += 1
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].float(), -1)
        joint = torch.stack([p1[a] * torch.softmax(target(torch.tensor([prompt + [a]])).logits[0, -1].float(), -1)
                             for a in range(6)]).flatten()
    assert chi2_pvalue(counts.numpy(), joint.numpy()) > 1e-3


def test_cuda_graphs_on_needs_a_gpu():
    with pytest.raises(EngineError, match="CUDA"):
        SpecEngine(tiny(), options=small_options(cuda_graphs="on"))


@CUDA
@pytest.mark.parametrize("draft_spec", ["truncate:1", "head"])
def test_graph_path_equals_eager_path_on_cuda(draft_spec):
    target = tiny(layers=3).cuda()
    if draft_spec == "head":
        draft = build_head(target, DraftSpec(family="head", feature_layers=(0, 1, 2)), torch.arange(200).cuda())
    else:
        draft = build_draft(draft_spec, target)
    prompt = [17, 200, 3, 99, 45, 8, 9]
    outs = []
    for mode in ("off", "on"):
        eng = SpecEngine(target, draft, options=small_options(k=3, max_seq_len=64, cuda_graphs=mode))
        outs.append(eng.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids)
    ar = SpecEngine(target, options=small_options(k=0, max_seq_len=64, cuda_graphs="on"))
    assert outs[0] == outs[1] == ar.generate(prompt, GenerationParams(max_new_tokens=24)).output_ids
