"""infra/drafts/layer.py: the draft family built from a target, and its on-disk format."""

import json

import pytest
import torch
from safetensors import safe_open

from infra.target import MANIFEST, TargetError, build_tiny_llama, tiny_tokenizer
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from infra.drafts.layer import (
    EMBED,
    HEAD,
    INFO_FILE,
    NORM,
    WEIGHTS_FILE,
    DraftLoadError,
    DraftSpec,
    DraftSpecError,
    build_draft,
    layer_indices,
    load_draft,
    save_draft,
    shared_names,
    trainable_state_dict,
)

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

REF = {"spec": "tiny-random:0", "sha256": "cd" * 32}


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(seed=0, num_layers=4)


def _tied_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg).eval()


def _ids(n=12):
    return torch.arange(3, 3 + n).unsqueeze(0)


def _layer_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- building

def test_shared_tensors_share_storage_and_are_frozen(target):
    draft = build_draft(target, DraftSpec(num_layers=2))
    assert set(shared_names(draft)) == {EMBED, NORM, HEAD}
    for mine, theirs in ((draft.model.embed_tokens, target.model.embed_tokens),
                         (draft.model.norm, target.model.norm), (draft.lm_head, target.lm_head)):
        assert mine.weight.data_ptr() == theirs.weight.data_ptr()
        assert not mine.weight.requires_grad
    # The target's own parameters are untouched.
    assert all(p.requires_grad for p in target.parameters())
    assert not any(b.is_meta for b in draft.buffers())
    assert torch.equal(draft.model.rotary_emb.inv_freq, target.model.rotary_emb.inv_freq)


def test_layers_are_trainable_copies(target):
    draft = build_draft(target, DraftSpec(num_layers=2))
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    for layer in draft.model.layers:
        for p in layer.parameters():
            assert p.requires_grad
            assert p.data_ptr() not in target_ptrs
    # Training the copy leaves the target alone.
    before = target.model.layers[0].mlp.up_proj.weight.clone()
    with torch.no_grad():
        draft.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(target.model.layers[0].mlp.up_proj.weight, before)


@pytest.mark.parametrize("source,n,want", [("first", 2, [0, 1]), ("first", 4, [0, 1, 2, 3]),
                                           ("spaced", 2, [0, 3]), ("spaced", 3, [0, 2, 3]),
                                           ("spaced", 1, [0]), ("spaced", 4, [0, 1, 2, 3])])
def test_layer_sources_pick_the_right_layers(target, source, n, want):
    spec = DraftSpec(num_layers=n, layer_source=source)
    assert layer_indices(spec, 4) == want
    draft = build_draft(target, spec)
    for j, i in enumerate(want):
        assert _layer_equal(draft.model.layers[j], target.model.layers[i])
    if source == "spaced" and n == 2:
        assert not _layer_equal(draft.model.layers[1], target.model.layers[1])


def test_layer_indices_spaced_on_thirty_layers():
    assert layer_indices(DraftSpec(num_layers=4, layer_source="spaced"), 30) == [0, 10, 19, 29]


def test_share_layers_draft_is_the_targets_own_tensors(target):
    shared = build_draft(target, DraftSpec(num_layers=2, share_layers=True))
    tp = dict(target.named_parameters())
    for name, p in shared.named_parameters():
        assert p.data_ptr() == tp[name].data_ptr() and not p.requires_grad, name
    assert set(shared_names(shared)) == set(shared.state_dict()) and trainable_state_dict(shared) == {}
    assert all(p.requires_grad for p in target.parameters())  # the target's own Parameters untouched
    # The same function as copies of the first two layers.
    copied = build_draft(target, DraftSpec(num_layers=2))
    with torch.no_grad():
        assert torch.equal(shared(_ids()).logits, copied(_ids()).logits)
    spaced = build_draft(target, DraftSpec(num_layers=2, layer_source="spaced", share_layers=True))
    q_proj = [layer.self_attn.q_proj.weight.data_ptr() for layer in (spaced.model.layers[1], target.model.layers[3])]
    assert q_proj[0] == q_proj[1]  # draft layer 1 is target layer 3


def test_share_layers_with_other_sizes_is_refused(target):
    with pytest.raises(DraftSpecError, match="share_layers"):
        build_draft(target, DraftSpec(num_layers=2, intermediate_size=64, share_layers=True))
    with pytest.raises(DraftSpecError, match="share_layers"):
        build_draft(target, DraftSpec(num_layers=2, hidden_size=32, independent_head=True, share_layers=True))


def test_share_layers_draft_is_not_saved(target, tmp_path):
    """Saving writes trainable tensors only: a shared-layer draft would be saved as nothing, and
    load onto any same-shaped target as that target's layers. It is refused, nothing written."""
    spec = DraftSpec(num_layers=2, share_layers=True)
    with pytest.raises(DraftSpecError, match="truncate:L"):
        save_draft(build_draft(target, spec), spec, tmp_path / "d", target_ref=REF)
    with pytest.raises(DraftSpecError, match="truncate:L"):  # under a spec that does not say so
        save_draft(build_draft(target, spec), DraftSpec(num_layers=2), tmp_path / "d", target_ref=REF)
    assert list(tmp_path.iterdir()) == []


def test_too_many_layers_and_bad_hidden_size_are_refused(target):
    with pytest.raises(DraftSpecError, match="only 4"):
        build_draft(target, DraftSpec(num_layers=5))
    with pytest.raises(DraftSpecError, match="independent_head=True"):
        build_draft(target, DraftSpec(num_layers=2, hidden_size=32))


def test_independent_head_is_a_trainable_copy(target):
    draft = build_draft(target, DraftSpec(num_layers=2, independent_head=True))
    assert shared_names(draft) == (EMBED,)
    assert draft.lm_head.weight.requires_grad and draft.model.norm.weight.requires_grad
    assert draft.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert not draft.model.embed_tokens.weight.requires_grad


def test_other_hidden_size_is_seeded_random_and_fully_independent(target):
    spec = DraftSpec(num_layers=2, hidden_size=32, intermediate_size=48, independent_head=True, seed=7)
    a, b = build_draft(target, spec), build_draft(target, spec)
    assert shared_names(a) == ()
    assert a.config.hidden_size == 32 and a.config.head_dim == 8
    assert all(p.requires_grad for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_draft(target, spec.model_copy(update={"seed": 8}))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    with torch.no_grad():
        assert a(_ids()).logits.shape == (1, 12, 259)


def test_other_intermediate_size_keeps_attention_copies(target):
    draft = build_draft(target, DraftSpec(num_layers=2, intermediate_size=48))
    assert set(shared_names(draft)) == {EMBED, NORM, HEAD}
    assert torch.equal(draft.model.layers[1].self_attn.q_proj.weight, target.model.layers[1].self_attn.q_proj.weight)
    assert draft.model.layers[1].mlp.up_proj.weight.shape == (48, 64)


def test_tied_target(tmp_path):
    tied = _tied_target()
    draft = build_draft(tied, DraftSpec(num_layers=2))
    assert draft.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert set(trainable_state_dict(draft)) == {k for k in draft.state_dict() if k.startswith("model.layers.")}
    indep = build_draft(tied, DraftSpec(num_layers=2, independent_head=True))
    assert not indep.config.tie_word_embeddings
    assert indep.lm_head.weight.data_ptr() != indep.model.embed_tokens.weight.data_ptr()
    for d, spec in ((draft, DraftSpec(num_layers=2)), (indep, DraftSpec(num_layers=2, independent_head=True))):
        save_draft(d, spec, tmp_path / str(spec.independent_head), target_ref=REF)
        loaded, _ = load_draft(tmp_path / str(spec.independent_head), tied)
        with torch.no_grad():
            assert torch.equal(loaded(_ids()).logits, d(_ids()).logits)


# ---------------------------------------------------------------- save / load

@pytest.mark.parametrize("spec", [DraftSpec(num_layers=2), DraftSpec(num_layers=3, layer_source="spaced"),
                                  DraftSpec(num_layers=2, independent_head=True),
                                  DraftSpec(num_layers=2, hidden_size=32, independent_head=True)],
                         ids=["first", "spaced", "indep-head", "hidden32"])
def test_round_trip_gives_identical_logits(target, tmp_path, spec):
    draft = build_draft(target, spec)
    with torch.no_grad():  # a trained draft differs from its init
        for p in trainable_state_dict(draft).values():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    out = save_draft(draft, spec, tmp_path / "d", target_ref=REF, lineage={"parent": None, "step": 10},
                     metrics={"acceptance": 0.5})
    loaded, info = load_draft(out, target)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, draft(_ids()).logits)
    assert info["spec"] == spec.model_dump(mode="json")
    assert info["target_ref"] == REF and info["lineage"]["step"] == 10 and info["metrics"]["acceptance"] == 0.5
    assert set(shared_names(loaded)) == set(shared_names(draft))
    for name in shared_names(loaded):
        assert loaded.get_parameter(name).data_ptr() == target.get_parameter(name).data_ptr()
        assert not loaded.get_parameter(name).requires_grad
    assert not any(b.is_meta for b in loaded.buffers())


def test_saved_files_hold_only_trainable_tensors(target, tmp_path):
    spec = DraftSpec(num_layers=2)
    draft = build_draft(target, spec)
    save_draft(draft, spec, tmp_path / "d", target_ref=REF)
    d = tmp_path / "d"
    assert sorted(p.name for p in d.iterdir()) == sorted(["config.json", WEIGHTS_FILE, INFO_FILE, MANIFEST])
    with safe_open(str(d / WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
    assert names == set(trainable_state_dict(draft, spec))
    assert not names & {EMBED, NORM, HEAD}
    trainable_bytes = sum(v.numel() * v.element_size() for v in trainable_state_dict(draft).values())
    assert (d / WEIGHTS_FILE).stat().st_size < trainable_bytes + 8192
    info = json.loads((d / INFO_FILE).read_text())
    assert set(info["shared_tensors"]) == {EMBED, NORM, HEAD}
    assert info["layer_indices"] == [0, 1]
    manifest = json.loads((d / MANIFEST).read_text())
    assert set(manifest["files"]) == {"config.json", WEIGHTS_FILE, INFO_FILE}
    assert not list(tmp_path.glob(".d.tmp-*"))  # no temp dir left behind


def test_existing_directory_needs_overwrite(target, tmp_path):
    spec = DraftSpec(num_layers=2)
    draft = build_draft(target, spec)
    save_draft(draft, spec, tmp_path / "d", target_ref=REF)
    with pytest.raises(FileExistsError):
        save_draft(draft, spec, tmp_path / "d", target_ref=REF)
    save_draft(draft, spec, tmp_path / "d", target_ref=REF, metrics={"v": 2}, overwrite=True)
    assert load_draft(tmp_path / "d", target)[1]["metrics"] == {"v": 2}


@pytest.fixture
def saved(target, tmp_path):
    spec = DraftSpec(num_layers=2)
    return save_draft(build_draft(target, spec), spec, tmp_path / "d", target_ref=REF)


def test_truncated_weights_are_refused(target, saved):
    p = saved / WEIGHTS_FILE
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DraftLoadError, match="truncated"):
        load_draft(saved, target)


def test_digest_mismatch_is_refused(target, saved):
    p = saved / WEIGHTS_FILE
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(DraftLoadError, match="digest mismatch"):
        load_draft(saved, target)


def test_missing_manifest_is_refused(target, saved):
    (saved / MANIFEST).unlink()
    with pytest.raises(DraftLoadError, match=f"no {MANIFEST}") as e:
        load_draft(saved, target)
    assert isinstance(e.value, TargetError)  # callers catching TargetError see it too


def test_missing_file_and_directory_are_refused(target, saved, tmp_path):
    (saved / INFO_FILE).unlink()
    with pytest.raises(DraftLoadError, match="missing"):
        load_draft(saved, target)
    with pytest.raises(DraftLoadError, match="does not exist"):
        load_draft(tmp_path / "nope", target)


def test_mismatched_target_is_refused(saved):
    with pytest.raises(DraftLoadError, match="vocab"):
        load_draft(saved, build_tiny_llama(num_layers=4, vocab_size=300))
    with pytest.raises(DraftLoadError, match="hidden size"):
        load_draft(saved, build_tiny_llama(num_layers=4, hidden_size=32))


def test_expected_target_digest_is_checked(target, saved, tmp_path):
    with pytest.raises(DraftLoadError, match=r"\(sha256 cdcdcdcdcdcd…\), not this one \(sha256 abababababab…\)"):
        load_draft(saved, target, expect_target_sha256="ab" * 32)
    assert load_draft(saved, target, expect_target_sha256="cd" * 32)[1]["target_ref"] == REF
    # Drafts saved before the identity was recorded cannot be told apart: the shapes decide.
    spec = DraftSpec(num_layers=1)
    old = save_draft(build_draft(target, spec), spec, tmp_path / "old", target_ref={"spec": "x", "sha256": None})
    load_draft(old, target, expect_target_sha256="ab" * 32)


def test_saved_spec_leaves_out_share_layers(saved):
    """Always False when saved; absent, so code from before the option still reads the draft."""
    assert "share_layers" not in json.loads((saved / INFO_FILE).read_text())["spec"]


def test_digests_the_caller_checked_are_not_hashed_again(target, saved, monkeypatch):
    import infra.target

    manifest = json.loads((saved / MANIFEST).read_text())["files"]
    verified = {name: meta["sha256"] for name, meta in manifest.items()}
    hashed = []
    real = infra.target.sha256_file
    monkeypatch.setattr(infra.target, "sha256_file", lambda p, *a, **k: hashed.append(p.name) or real(p, *a, **k))
    load_draft(saved, target, verified=verified)
    assert hashed == []
    load_draft(saved, target)  # without: each file once
    assert sorted(hashed) == sorted(manifest)
    with pytest.raises(DraftLoadError, match=WEIGHTS_FILE):
        load_draft(saved, target, verified={**verified, WEIGHTS_FILE: "00" * 32})


def test_saved_draft_serves_like_the_in_memory_one(tmp_path):
    tok = tiny_tokenizer()
    target = build_tiny_llama(seed=0, num_layers=4, max_positions=128)
    target.config.eos_token_id = None  # fixed-length runs
    spec = DraftSpec(num_layers=2, layer_source="spaced")
    draft = build_draft(target, spec)
    with torch.no_grad():
        for p in trainable_state_dict(draft).values():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    loaded, _ = load_draft(save_draft(draft, spec, tmp_path / "d", target_ref=REF), target)
    opts = small_options(k=3, max_seq_len=128, k_policy="fixed")
    params = GenerationParams(max_new_tokens=24)
    prompt = [tok.bos_token_id, *tok.encode("speculate on this")]
    mem = SpecEngine(target, draft, None, opts).generate(prompt, params)
    disk = SpecEngine(target, loaded, None, opts).generate(prompt, params)
    assert disk.output_ids == mem.output_ids
    assert disk.stats.num_accepted_tokens == mem.stats.num_accepted_tokens
    assert disk.stats.num_draft_tokens == mem.stats.num_draft_tokens
    assert disk.capture.draft_tokens.tolist() == mem.capture.draft_tokens.tolist()
    # The draft alone, greedy, as the model being decoded.
    ar = GenerationParams(max_new_tokens=24)
    a = SpecEngine(draft, None, None, opts).generate(prompt, ar)
    b = SpecEngine(loaded, None, None, opts).generate(prompt, ar)
    assert a.output_ids == b.output_ids


def test_serve_draft_spec_accepts_a_published_directory(target, tmp_path):
    from serve.spec_decode.specs import DraftSpecError, build_draft as serve_draft

    spec = DraftSpec(num_layers=2)
    d = build_draft(target, spec)
    out = save_draft(d, spec, tmp_path / "v1", target_ref=REF)
    loaded = serve_draft(str(out), target)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, d(ids).logits)
    with pytest.raises(DraftSpecError, match="draft directory"):
        serve_draft(str(tmp_path / "missing"), target)
