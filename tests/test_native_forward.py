"""The native CPU forward (serve/model/): its kernels against the weights they encode, every
build this CPU runs giving the same bits, a row's result independent of the rows beside it
(so a verify equals its decodes and a batched step equals each sequence alone), its logits
against the PyTorch int4 runner's, speculation equal to its own AR, and the set-up's
fallbacks (no AVX-512, no compiler) saying why."""

import ctypes
import logging

import pytest
import torch
from chi2 import chi2_pvalue, sample_first_two

from infra.target import build_tiny_llama
from serve.model.batch_forward import Item, forward_batch
from serve.spec_decode.specs import build_draft
from serve.engine.core import EngineError, GenerationParams, SpecEngine
from engine_options import small_options
from serve.model.linear import dequantize_int4, int4_codes
from serve.model import native_build
from serve.model.native_build import NativeUnavailable
from serve.model.native_formats import dequantize_q4, pack_q4, pack_q4_codes, pack_q8, q8_codes
from serve.model.native_runner import NativeLlamaRunner
from serve.model.runner import LlamaRunner
from native_builds import BUILDS, VARIANTS, load_build
from serve.model.factory import make_runner
from serve.sampling.verify import SamplingParams, warp_probs

pytestmark = [pytest.mark.pure]

needs_native = pytest.mark.skipif(not VARIANTS, reason="this CPU runs no native variant")
# head_dim 32 and 16 (the kernels take multiples of 16), grouped-query attention, a vocabulary
# that is not a multiple of 16 (the head's padded tile).
SHAPES = {"hd32": dict(vocab_size=304, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256),
          "hd16-odd-vocab": dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)}


def tiny(shape="hd32", seed=0, on_grid=False, layers=3):
    m = build_tiny_llama(seed=seed, num_layers=layers, max_positions=160, dtype="bfloat16", **SHAPES[shape])
    m.config.eos_token_id = None
    if on_grid:  # decoder weights int4 holds exactly: the float model is the model both runners encode
        with torch.no_grad():
            for name, p in m.model.layers.named_parameters():
                if p.dim() == 2:
                    p.copy_(dequantize_int4(*int4_codes(p)).to(p.dtype))
    return m


def runner(model, variant=None):
    lib = load_build(variant) if variant else None
    return NativeLlamaRunner(model, 160, lib=lib)


def logits(r, tokens, prefix=0):
    cache = r.new_cache()
    if prefix:
        r.forward(tokens[:prefix], cache)
    return r.forward(tokens[prefix:], cache)


def gemm(lib, packed, q4, n, k, x):
    y = torch.empty(x.shape[0], n)
    lib.osd_gemm(packed.data_ptr(), int(q4), n, k, x.data_ptr(), x.shape[0], y.data_ptr(), 2)
    return y


# ---------------------------------------------------------------- kernels


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("q4", [True, False])
def test_gemm_multiplies_by_the_weights_it_packs(variant, q4):
    """Against float64 products with the packed weights: the only error left is the
    activations' int8 rounding (blocks of 32, scale max/127)."""
    lib = native_build.load_variant(variant)
    n, k = 96, 160
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    if q4:
        packed, wref = pack_q4(w), dequantize_q4(*int4_codes(w))
    else:
        codes, scale = q8_codes(w)
        packed, wref = pack_q8(w), codes.float() * scale.repeat_interleave(32, 1)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ wref.double().t()
    err = (gemm(lib, packed, q4, n, k, x).double() - ref).abs().max() / ref.abs().max()
    assert 1e-5 < err < 2e-2  # int8 activations: not exact, and not far off


@needs_native
@pytest.mark.parametrize("q4", [True, False])
def test_gemm_rows_do_not_depend_on_their_neighbours_and_variants_agree_bitwise(q4):
    n, k = 64, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    packed = pack_q4(w) if q4 else pack_q8(w)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))  # 19: several row tiles
    outs = {}
    for v in BUILDS:
        lib = load_build(v)
        outs[v] = gemm(lib, packed, q4, n, k, x)
        alone = torch.cat([gemm(lib, packed, q4, n, k, x[i:i + 1].contiguous()) for i in range(19)])
        assert torch.equal(alone, outs[v]), v
        for m in range(2, 19):  # every way a call's rows are shared out among row tiles
            assert torch.equal(gemm(lib, packed, q4, n, k, x[:m].contiguous()), outs[v][:m]), (v, m)
    first = next(iter(outs.values()))
    assert all(torch.equal(first, o) for o in outs.values())


@needs_native
def test_gemm_is_exact_at_the_largest_codes_and_activations():
    """Codes 15 (and 0) against activations at +-127 of their scale: the largest integer
    dots a block can hold (the AVX2 kernel sums a block's pairs in int16 before widening),
    equal to the exact integer products on every build."""
    n, k = 32, 128
    codes = torch.full((n, k), 15, dtype=torch.int64)
    codes[n // 2:, ::2] = 0  # half the columns alternate 15 and 0 against the same signs
    scale, lo = torch.full((n, k // 32), 0.5), torch.zeros(n, k // 32)
    packed = pack_q4_codes(codes, scale, lo)
    x = torch.ones(3, k)
    x[1] = -1.0  # q = -127 throughout
    x[2, 64:] = -1.0
    want = (x.double() * 127).round() @ (codes.double() * 0.5).t() / 127  # |x| = 1: scale 1/127
    for v in BUILDS:
        got = gemm(load_build(v), packed, True, n, k, x)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), v


def amx_lib():
    """The AVX-512 build where this CPU and kernel run AMX tiles, else None."""
    if "avx512" not in VARIANTS:
        return None
    lib = native_build.load_variant("avx512")
    return lib if lib.osd_set_amx(0) else None


needs_amx = pytest.mark.skipif(amx_lib() is None, reason="no AMX-INT8 here (or the kernel refuses it)")


@needs_amx
@pytest.mark.parametrize("q4", [True, False])
def test_amx_tiles_give_the_vnni_kernels_bits_at_every_row_count(q4):
    """AMX from one row: full 16-row tiles and partial ones (reading past the last row into the
    activations' slack) against the VNNI kernels and against each row alone."""
    lib = amx_lib()
    n, k = 48, 160
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    packed = pack_q4(w) if q4 else pack_q8(w)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(8)) * 3
    try:
        for m in (1, 3, 9, 15, 16, 17, 32, 37):
            lib.osd_set_amx(0)
            vnni = gemm(lib, packed, q4, n, k, x[:m].contiguous())
            lib.osd_set_amx(1)
            tiles = gemm(lib, packed, q4, n, k, x[:m].contiguous())
            assert torch.equal(vnni, tiles), m
        alone = torch.cat([gemm(lib, packed, q4, n, k, x[i:i + 1].contiguous()) for i in range(37)])
        assert torch.equal(alone, tiles)
    finally:
        lib.osd_set_amx(0)


@needs_amx
def test_a_forward_on_amx_tiles_equals_the_vnni_forward_and_its_decodes():
    lib = amx_lib()
    model = tiny()
    r = NativeLlamaRunner(model, 160, lib=lib)
    tokens = torch.randint(0, 304, (60,), generator=torch.Generator().manual_seed(9))
    try:
        for t in (5, 9, 16, 33):
            out = {}
            for amx in (0, 9):
                lib.osd_set_amx(amx)
                out[amx] = logits(r, tokens[:11 + t], 11)
            assert torch.equal(out[0], out[9]), t
        lib.osd_set_amx(9)
        cache = r.new_cache()
        r.forward(tokens[:11], cache)
        decodes = torch.cat([r.forward(tokens[i:i + 1], cache) for i in range(11, 44)])
        assert torch.equal(decodes, out[9])
    finally:
        lib.osd_set_amx(0)


@needs_amx
def test_amx_tiles_survive_torchs_own_amx_kernels_on_the_same_thread():
    """oneDNN's bfloat16 matmuls (AMX on such a CPU) load their own tile configuration and release
    the tiles; a GEMM after one must load ours again, not die of an illegal instruction. In a
    subprocess, so that such a death fails this test instead of the run."""
    import subprocess
    import sys

    code = """
import torch
from serve.model import native_build
from serve.model.native_formats import pack_q4
lib = native_build.load_variant("avx512")
lib.osd_set_amx(1)
torch.set_num_threads(1)
w, x, y = pack_q4(torch.randn(96, 160)), torch.randn(20, 160), torch.empty(20, 96)
a, b = torch.randn(64, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
for _ in range(20):
    lib.osd_gemm(w.data_ptr(), 1, 96, 160, x.data_ptr(), 20, y.data_ptr(), 2)
    a @ b
print("done")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_pack_q4_keeps_the_codes_and_scales_in_their_places():
    """One weight of known code per column and block, read back from the packed bytes."""
    n, k = 16, 64
    codes = torch.arange(n * k).reshape(n, k) % 16
    scale = torch.arange(1, n * k // 32 + 1, dtype=torch.float32).reshape(n, k // 32)
    lo = -scale
    packed = pack_q4_codes(codes, scale, lo)
    assert packed.numel() == (n // 16) * (k // 32) * 320
    blk = packed[320:640]  # tile 0, block 1
    c, j, i = 5, 2, 3  # column 5, chunk 2, byte 3: inputs 32 + 16 + 3 (low) and 32 + 20 + 3 (high)
    byte = int(blk[64 * j + 4 * c + i])
    assert byte & 15 == codes[c, 32 + 8 * j + i] and byte >> 4 == codes[c, 32 + 8 * j + 4 + i]
    d = blk[256:288].view(torch.float16)
    m = blk[288:320].view(torch.float16)
    assert d[c].item() == scale[c, 1].item() and m[c].item() == lo[c, 1].item()


# ---------------------------------------------------------------- the forward


@needs_native
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 5, 16, 33])
@pytest.mark.parametrize("prefix", [0, 9])
def test_native_logits_match_the_torch_int4_runner_to_rounding(shape, t, prefix):
    """Both encode the same int4 weights (a model on int4's grid, so the float32 model is the
    one they compute); the native path rounds activations to int8 blocks where PyTorch's
    rounds them to bfloat16, so each is held against the float32 logits: the native error is
    of the size of the PyTorch int4 runner's."""
    model = tiny(shape, seed=t, on_grid=True)
    ref32 = LlamaRunner(tiny(shape, seed=t, on_grid=True).float(), 160)
    tokens = torch.randint(0, model.config.vocab_size, (prefix + t,), generator=torch.Generator().manual_seed(t))
    want = logits(ref32, tokens, prefix)
    native = logits(runner(model), tokens, prefix)
    torch_int4 = logits(LlamaRunner(model, 160, "int4"), tokens, prefix)
    err_native = (native - want).abs().max().item()
    err_torch = (torch_int4 - want).abs().max().item()
    assert native.shape == want.shape and native.dtype == torch.float32
    assert err_native < 0.05 * want.abs().max().item()
    assert err_native < 3 * err_torch + 1e-2, (err_native, err_torch)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_verify_block_equals_its_decodes_bit_for_bit(variant):
    model = tiny()
    r = runner(model, variant)
    tokens = torch.randint(0, 304, (30,), generator=torch.Generator().manual_seed(5))
    for t in (2, 5, 16):
        a, b = r.new_cache(), r.new_cache()
        r.forward(tokens[:11], a)
        r.forward(tokens[:11], b)
        block = r.forward(tokens[11:11 + t], a)
        decodes = torch.cat([r.forward(tokens[i:i + 1], b) for i in range(11, 11 + t)])
        assert torch.equal(block, decodes), t
        assert torch.equal(a.k[:, :, :11 + t], b.k[:, :, :11 + t])


@needs_native
def test_every_variant_computes_the_same_logits():
    model = tiny()
    tokens = torch.randint(0, 304, (45,), generator=torch.Generator().manual_seed(6))
    for prefix in (0, 33):  # a 45-row prompt, and a 12-row verify over a cache of 33
        outs = [logits(runner(model, v), tokens, prefix) for v in BUILDS]
        assert all(torch.equal(outs[0], o) for o in outs), prefix


@needs_native
def test_three_queries_a_kv_head_stay_exact_across_variants_and_row_counts():
    """Three query heads a KV head: attention tiles of one to four queries and every
    remainder, in a verify block and in its decodes, on every variant."""
    model = build_tiny_llama(seed=11, num_layers=2, max_positions=160, dtype="bfloat16", vocab_size=304,
                             hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=192)
    model.config.eos_token_id = None
    tokens = torch.randint(0, 304, (40,), generator=torch.Generator().manual_seed(11))
    blocks = []
    for v in BUILDS:
        r = runner(model, v)
        block = logits(r, tokens, 21)
        cache = r.new_cache()
        r.forward(tokens[:21], cache)
        decodes = torch.cat([r.forward(tokens[i:i + 1], cache) for i in range(21, 40)])
        assert torch.equal(block, decodes), v
        blocks.append(block)
    assert all(torch.equal(blocks[0], b) for b in blocks)


@needs_native
def test_a_batched_step_equals_each_sequence_alone():
    """Decode rows in a pool, a verify block and a prompt chunk in one native call: every
    sequence's logits, features and cache equal its own forward's, bit for bit."""
    model = tiny()
    r = runner(model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 304, (n,), generator=gen) for n in (5, 12, 3, 8)]
    new = [torch.randint(0, 304, (t,), generator=gen) for t in (1, 1, 4, 6)]
    pooled = r.new_caches(4, growable=True)
    alone = [r.new_cache() for _ in prompts]
    for p, c1, c2 in zip(prompts, pooled, alone):
        r.forward(p, c1)
        r.forward(p, c2)
    items = [Item(t, c, logits=(i != 3)) for i, (t, c) in enumerate(zip(new, pooled))]
    got = forward_batch(r, items, layers=(0, 2))
    for i, (t, c) in enumerate(zip(new, alone)):
        lg, ft = r.forward_features(t, c, (0, 2))
        if i == 3:
            assert got[i][0] is None
        else:
            assert torch.equal(got[i][0], lg)
        assert torch.equal(got[i][1], ft)
        n = c.length
        assert pooled[i].length == n and torch.equal(pooled[i].k[:, :, :n], c.k[:, :, :n])


@needs_native
def test_forwards_from_two_threads_stay_exact():
    """Two engines' threads may call the library at once: it runs one forward at a time."""
    import threading

    model = tiny()
    runners = [runner(model), runner(model)]
    tokens = torch.randint(0, 304, (45,), generator=torch.Generator().manual_seed(10))

    def once(r):
        c = r.new_cache()
        r.forward(tokens[:40], c)
        return r.forward(tokens[40:], c)

    want = once(runners[0])
    bad = []

    def loop(r):
        for _ in range(50):
            if not torch.equal(once(r), want):
                bad.append(r)

    threads = [threading.Thread(target=loop, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad and not any(t.is_alive() for t in threads)


@needs_native
def test_features_are_the_layers_outputs():
    """forward_features' layer outputs feed the head draft: the last layer's, normed and
    multiplied by the head weights (float64 here), give the logits up to int8 rounding."""
    model = tiny()
    r = runner(model)
    tokens = torch.randint(0, 304, (6,), generator=torch.Generator().manual_seed(8))
    lg, feats = r.forward_features(tokens, r.new_cache(), (1, 2))
    assert feats.shape == (6, 2 * 128) and feats.dtype == torch.bfloat16
    h = feats[:, 128:].double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    want = (normed * model.model.norm.weight.double()) @ model.lm_head.weight.double().t()
    assert (lg.double() - want).abs().max() < 0.03 * want.abs().max()


@needs_native
def test_bad_input_is_refused_before_anything_is_written():
    model = tiny()
    r = runner(model)
    cache = r.new_cache()
    r.forward(torch.tensor([1, 2, 3]), cache)
    before = cache.k.clone()
    with pytest.raises(ValueError, match="out of range"):
        r.forward(torch.tensor([4, 304]), cache)
    assert cache.length == 3 and torch.equal(cache.k, before)
    with pytest.raises(ValueError, match="exceeds"):
        r.forward(torch.zeros(158, dtype=torch.long), cache)
    assert cache.length == 3
    from serve.model.batch_forward import Item

    tree = Item(torch.tensor([5, 6]), cache, pos=torch.tensor([3, 4]), visible=torch.ones(2, cache.max_len, dtype=torch.bool))
    with pytest.raises(ValueError, match="draft trees"):  # a masked block: the native forward runs chains only
        r.forward_rows([tree])
    assert cache.length == 3 and torch.equal(cache.k, before)


# ---------------------------------------------------------------- the engine on it


@needs_native
@pytest.mark.parametrize("draft", ["truncate:1", "suffix", "head:untrained", "head:untrained+suffix"])
def test_greedy_speculation_equals_the_native_targets_own_decoding(draft):
    model = tiny(layers=4)
    opts = dict(k=3, max_seq_len=160, quant="int4", k_policy="fixed")
    own = SpecEngine(model, None, options=small_options(**opts))
    assert isinstance(own.target, NativeLlamaRunner)
    spec = SpecEngine(model, build_draft(draft, model), options=small_options(**opts))
    params = GenerationParams(max_new_tokens=24)
    gen = torch.Generator().manual_seed(9)
    drafted = 0
    for _ in range(3):
        prompt = torch.randint(0, 304, (7,), generator=gen).tolist() * 2  # repeats: the suffix draft proposes
        out = spec.generate(prompt, params)
        assert out.output_ids == own.generate(prompt, params).output_ids
        drafted += out.stats.num_draft_tokens
    assert drafted > 0


V8 = dict(vocab_size=8, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)


@needs_native
@pytest.mark.parametrize("draft", ["truncate:1", "head:untrained"])
def test_sampling_on_the_native_target_follows_its_distribution(draft):
    """Chi-square: sampled speculation on the native int4 target draws the first two tokens
    from the distribution of its own one-row forwards (vocabulary 8: the head's LM head padded
    to a tile of 16), with a layer draft and with the native head draft."""
    from serve.spec_decode.head.native import NativeHead

    target = build_tiny_llama(seed=3, num_layers=2, max_positions=32, dtype="bfloat16", **V8)
    target.config.eos_token_id = None
    eng = SpecEngine(target, build_draft(draft, target),
                     options=small_options(k=2, max_seq_len=32, quant="int4", k_policy="fixed"))
    assert isinstance(eng.target, NativeLlamaRunner)
    if draft.startswith("head"):
        assert isinstance(eng.draft.kernel, NativeHead)
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    counts, drafted, accepted = sample_first_two(eng, [1, 2, 3], sampling, 2000)
    assert drafted - accepted > 200 and accepted > 200  # both the accept and the residual paths ran

    def last(ids):
        return eng.target.forward(torch.tensor(ids), eng.target.new_cache())[-1]

    p1 = warp_probs(last([1, 2, 3]), sampling)
    p2 = torch.stack([warp_probs(last([1, 2, 3, t]), sampling) for t in range(8)])
    assert chi2_pvalue(counts, p1[:, None] * p2) > 1e-3


def test_trees_keep_the_torch_kernels():
    model = tiny()
    eng = SpecEngine(model, build_draft("truncate:1", model),
                     options=small_options(k=3, max_seq_len=160, quant="int4", tree="4,2,2"))
    assert type(eng.target) is LlamaRunner
    with pytest.raises(EngineError, match="serve.tree"):
        SpecEngine(model, None, options=small_options(max_seq_len=160, quant="int4", tree="4,2,2",
                                                      cpu_kernels="native"))


# ---------------------------------------------------------------- set-up and fallbacks


def test_an_avx2_only_cpu_builds_the_avx2_variant(tmp_path, monkeypatch):
    zen3 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
    assert native_build.supported(zen3) == ["avx2"]
    assert native_build.supported({"sse2"}) == []
    monkeypatch.setenv("OSD_NATIVE_DIR", str(tmp_path))
    out = native_build.build("avx2")
    assert out.exists() and out.parent.parent == tmp_path
    if "avx2" in VARIANTS:
        lib = native_build._bind(ctypes.CDLL(str(out)))
        assert lib.osd_isa() == native_build.ISA_CODES["avx2"]


def test_without_a_compiler_the_int4_target_falls_back_saying_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OSD_NATIVE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "no-such-compiler")
    native_build.load_variant.cache_clear()
    try:
        with pytest.raises(NativeUnavailable, match="no C\\+\\+ compiler"):
            native_build.load()
        assert "unavailable" in native_build.status() and "no-such-compiler" in native_build.status()
        model = tiny()
        with caplog.at_level(logging.WARNING):
            r = make_runner(model, 160, "int4")
        assert type(r) is LlamaRunner
        assert "no C++ compiler" in caplog.text
        with pytest.raises(ValueError, match="cpu_kernels native"):
            make_runner(model, 160, "int4", "native")
        with pytest.raises(EngineError, match="cpu_kernels"):
            small_options(cpu_kernels="fast")
    finally:
        native_build.load_variant.cache_clear()


def test_a_compile_error_is_reported_not_half_built(tmp_path, monkeypatch):
    monkeypatch.setenv("OSD_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "COMMON_FLAGS", native_build.COMMON_FLAGS + ("-fno-such-flag",))
    with pytest.raises(NativeUnavailable, match="compiling the avx2 kernels failed"):
        native_build.build("avx2")
    assert not list(tmp_path.rglob("*.so"))


def test_torch_kernels_on_request_and_for_models_the_tiles_do_not_fit():
    assert type(make_runner(tiny(), 160, "int4", "torch")) is LlamaRunner
    odd = build_tiny_llama(seed=0, num_layers=1, max_positions=64, dtype="bfloat16", vocab_size=300,
                           hidden_size=48, num_heads=3, num_kv_heads=1, intermediate_size=96)
    with pytest.raises(ValueError, match="hidden_size 48"):
        NativeLlamaRunner(odd, 64)


def test_a_lone_replica_takes_every_usable_core(tmp_path):
    from infra.common.cpu import replica_threads, usable_cores

    cores = usable_cores(tmp_path / "absent")
    assert cores >= 1
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")  # a container limited to one core
    assert usable_cores(quota) == 1
    quota.write_text("max 100000\n")
    assert usable_cores(quota) == cores
    assert replica_threads(0, 1, 1.0) == usable_cores()
    assert replica_threads(0, 3, 2.0) == 2  # replicas sharing a machine: their CPUs each
    assert replica_threads(3, 1, 1.0) == 3


@needs_native
def test_the_native_runner_builds_its_many_row_pytorch_weights_only_when_a_forward_needs_them(monkeypatch):
    import serve.model.native_runner
    from serve.model.runner import ROW_EXACT_MAX_T

    model = tiny(on_grid=True)
    r = runner(model)
    assert "prefill_blocks" not in vars(r) and "wide_head" not in vars(r)
    tokens = torch.randint(0, 300, (ROW_EXACT_MAX_T + 8,), generator=torch.Generator().manual_seed(3))
    natively = logits(r, tokens)
    assert "prefill_blocks" not in vars(r)  # these rows ran natively
    monkeypatch.setattr(serve.model.native_runner, "NATIVE_MAX_ROWS", ROW_EXACT_MAX_T)
    inherited = logits(r, tokens)  # more rows than the native path takes: the PyTorch path, built now
    assert "prefill_blocks" in vars(r)
    reference = LlamaRunner(model, 160, "int4")
    torch.testing.assert_close(inherited, reference.forward(tokens, reference.new_cache()))
    assert (natively.argmax(-1) == inherited.argmax(-1)).float().mean() > 0.8
    assert "prefill_blocks" in vars(LlamaRunner(model, 160, "int4"))  # a PyTorch runner builds them at once
