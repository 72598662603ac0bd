"""The one Draft protocol (serve/spec_decode/protocol.py): every family passes one contract, and the code that
drives drafts (engine, scheduler, stages) names no family."""

import ast
from pathlib import Path

import pytest
import torch
from chi2 import first_two_tokens_pvalue
from test_batching import tiny

from serve.spec_decode.protocol import Draft
from serve.spec_decode.specs import build_draft
from serve.engine.core import GenerationParams, SpecEngine
from engine_options import small_options
from serve.sampling.verify import SamplingParams

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]

FAMILIES = ["truncate:1", "head:untrained", "suffix", "head:untrained+suffix"]
SOURCES = {"truncate:1": {"layer"}, "head:untrained": {"head"}, "suffix": {"suffix"},
           "head:untrained+suffix": {"head", "suffix"}}


@pytest.fixture(scope="module")
def target():
    return tiny(layers=2)


def _prompts():
    gen = torch.Generator().manual_seed(1)
    motif = torch.randint(0, 256, (6,), generator=gen).tolist()
    noise = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 4, 20)]
    return [motif * 4, noise[0] + motif * 2 + noise[1], noise[2], [noise[1][0]]]  # the last: one token


def _engine(target, spec, **kw):
    opts = dict(k=4, max_seq_len=160, max_concurrency=4, prefill_chunk=16, k_policy="fixed")
    return SpecEngine(target, build_draft(spec, target), options=small_options(**{**opts, **kw}))


class _Recorder:
    """Wraps a draft class's protocol methods to check what each call returns."""

    def __init__(self, monkeypatch, draft: Draft, max_k: int):
        self.proposals, self.released, self.trees = [], [], []
        self.commits = 0
        self.vocab, self.max_k = draft.vocab_size, max_k
        parts = {type(getattr(draft, p)) for p in ("head", "suffix") if isinstance(getattr(draft, p, None), Draft)}
        for cls in {type(draft), *parts}:  # a hybrid's parts' proposals too
            self._wrap(monkeypatch, cls, top=cls is type(draft))

    def _wrap(self, monkeypatch, cls, top):
        propose, release, tree, commit = cls.propose, cls.release, cls.propose_tree, cls.commit

        def rec_propose(d, seqs, ks, ctx):
            out = propose(d, seqs, ks, ctx)
            assert len(out) == len(seqs)
            self.proposals += out
            return out

        def rec_release(d, seq):
            self.released.append(seq)  # the object: a freed seq's id may be reused
            return release(d, seq)

        def rec_tree(d, seq, shape, ctx):
            got = tree(d, seq, shape, ctx)
            self.trees.append(got)
            return got

        def rec_commit(d, seq, base, n, drafted, feats):
            commit(d, seq, base, n, drafted, feats)
            # The cache keeps committed tokens only: base + n of them before the next token.
            assert seq.dcache is None or seq.dcache.length <= base + n
            self.commits += 1

        monkeypatch.setattr(cls, "propose", rec_propose)
        monkeypatch.setattr(cls, "propose_tree", rec_tree)
        if top:  # the engine's calls only (a hybrid passes them on to its parts)
            monkeypatch.setattr(cls, "commit", rec_commit)
            monkeypatch.setattr(cls, "release", rec_release)

    def check(self, spec):
        for p in self.proposals:
            n = p.tokens.numel()
            assert p.tokens.dtype == torch.long and p.tokens.dim() == 1 and n <= self.max_k
            assert len(p.own) == n and all(0.0 <= x <= 1.0 for x in p.own)
            assert p.q is None or tuple(p.q.shape) == (n, self.vocab)
            assert not (p.point_mass and p.q is not None)
            assert bool(((p.tokens >= 0) & (p.tokens < self.vocab)).all())
            if n:
                assert p.source in SOURCES[spec]
        for t in self.trees:
            assert int(t.tokens.numel()) <= 6 and t.parents[0] == -1 and bool((t.parents[1:] < torch.arange(1, t.size)).all())


@pytest.mark.parametrize("spec", FAMILIES)
def test_every_draft_family_keeps_the_contract(target, spec, monkeypatch):
    """Greedy output is the target's for chains and trees, batched and alone; proposals have
    the protocol's shapes; every request is released once; a draft's cache never holds more
    than the committed tokens; per-source counts name the family."""
    ar = SpecEngine(target, None, options=small_options(k=0, max_seq_len=160, max_concurrency=4))
    prompts = _prompts()
    params = GenerationParams(max_new_tokens=30)
    want = [r.output_ids for r in ar.generate_many(prompts, params)]
    for tree in ("", "6,3,2"):
        eng = _engine(target, spec, tree=tree)
        assert isinstance(eng.draft, Draft) and eng.draft.family
        rec = _Recorder(monkeypatch, eng.draft, max(eng.options.k, eng.draft.max_chain))
        got = eng.generate_many(prompts, params) + eng.generate_many(prompts, params)  # 2nd: the index holds them
        assert [r.output_ids for r in got] == want + want, (spec, tree)
        assert len({id(q) for q in rec.released}) == len(rec.released) == 2 * len(prompts)
        assert rec.trees if tree else rec.proposals
        rec.check(spec)
        assert rec.commits == sum(r.stats.num_steps for r in got)
        used = {src for r in got for src in r.stats.by_source}
        assert used and used <= SOURCES[spec]
        monkeypatch.undo()


V8 = dict(vocab=8, layers=2, max_positions=40)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.mark.parametrize("spec", ["suffix", "head:untrained+suffix"])
def test_sampled_suffix_trees_follow_the_target(spec, monkeypatch):
    """Trees chosen from the suffix index (no draw) are verified by the target's own seeded
    draw per depth: the first two tokens (both from a tree step: 3 tokens left > depth 2)
    follow the target's distribution, and seeds reproduce. (Steps that propose nothing are
    tested with chains: tests/test_suffix_draft.py.)"""
    from serve.spec_decode.suffix.draft import SuffixDraft

    trees = []
    real = SuffixDraft.propose_tree

    def counting(d, seq, shape, ctx):
        got = real(d, seq, shape, ctx)
        trees.append(got.size - 1)
        return got

    monkeypatch.setattr(SuffixDraft, "propose_tree", counting)
    target = tiny(seed=3, **V8)
    eng = SpecEngine(target, build_draft(spec, target),
                     options=small_options(k=3, max_seq_len=40, max_concurrency=4, k_policy="fixed", tree="4,2,2"))
    n = 1200
    params = [GenerationParams(max_new_tokens=3, sampling=SamplingParams(1.0, seed=i)) for i in range(n)]
    results = [eng.generate(PROMPT, p) for p in params]
    assert first_two_tokens_pvalue(target, PROMPT, [r.output_ids for r in results], 8, SamplingParams(1.0)) > 1e-3
    assert len(trees) >= n and sum(t > 0 for t in trees) > n // 2  # trees were verified, most with nodes
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    assert 0 < accepted < drafted
    if spec == "suffix":
        assert [eng.generate(PROMPT, p).output_ids for p in params[:30]] == [r.output_ids for r in results[:30]]


# ---------------------------------------------------------------- no family branch

DRIVERS = ["serve/engine/core.py", "serve/engine/scheduler.py", "serve/engine/step.py", "serve/engine/stages.py",
           "serve/spec_decode/trees/stages.py", "serve/model/batch_forward.py"]
FAMILY_MODULES = {"serve.spec_decode.head.draft", "serve.spec_decode.layer", "serve.spec_decode.suffix.draft"}
FAMILY_NAMES = {"HeadRunner", "LayerDraft", "SuffixDraft", "HybridDraft", "WithSuffix", "is_head",
                "suffix_of", "propose_heads", "commit_head", "prefill_head"}
FAMILY_WORDS = {"head", "suffix", "layer", "head+suffix"}


def _family_mentions(path: Path) -> list[str]:
    """Imports of a family's module, its names, or a comparison with a family's name."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module in FAMILY_MODULES:
                found.append(f"imports {node.module}")
            found += [f"imports {a.name}" for a in node.names if a.name in FAMILY_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name in FAMILY_MODULES]
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in FAMILY_NAMES:
                found.append(f"uses {name}")
        elif isinstance(node, ast.Compare):
            consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            found += [f"compares with {c!r}" for c in consts if c in FAMILY_WORDS]
    return found


def test_the_code_that_drives_drafts_names_no_family():
    root = Path(__file__).resolve().parents[1]
    mentions = {p: _family_mentions(root / p) for p in DRIVERS}
    assert not any(mentions.values()), mentions


def test_the_family_check_catches_a_branch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from serve.spec_decode.head.draft import is_head\nfrom serve.x import HybridDraft\n"
                   "if seq.step_source == 'suffix' or is_head(d):\n    pass\n")
    assert sorted(_family_mentions(bad)) == ["compares with 'suffix'", "imports HybridDraft", "imports is_head",
                                             "imports serve.spec_decode.head.draft", "uses is_head"]
