"""`osd bench batch` (pipeline/bench/batch.py): its levels over a tiny in-process engine, and the
bad input it refuses before loading anything."""

import pytest
import torch

from engine_options import small_options
from infra.target import build_tiny_llama
from pipeline.bench.batch import run_levels, table
from pipeline.cli import build_parser
from serve.engine.core import SpecEngine
from serve.spec_decode.specs import build_draft

pytestmark = [pytest.mark.pure, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("bad", ["0,8", "1,x", "-4"])
def test_bad_levels_are_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "batch", "--clients", bad])
    assert e.value.code == 2
    assert "--clients" in capsys.readouterr().err


def test_levels_run_their_clients_together_and_each_level_on_prompts_of_its_own():
    """Each level on prompts of its own; speculation on and off of a level on the same ones
    (greedy: the same answers), and the on / off ratio from them."""
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=128)
    target.config.eos_token_id = None
    eng = SpecEngine(target, build_draft("truncate:1", target),
                     options=small_options(k=2, max_seq_len=128, max_concurrency=4, k_policy="fixed"))
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (6,), generator=gen).tolist() for _ in range(40)]
    made = []

    def draft(e):
        made.append(e.make_draft(build_draft("truncate:1", target)))
        return made[-1]

    rows = run_levels(eng, draft, ids, [1, 4], 2, 6, (True, False), log=lambda s: None)
    assert [(r["clients"], r["speculation"], r["requests"]) for r in rows] == [
        (1, True, 2), (1, False, 2), (4, False, 8), (4, True, 8)]  # the order alternates by level
    assert all(r["tokens"] == 6 * r["requests"] for r in rows)
    assert rows[0]["on_off"] == rows[0]["tok_s"] / rows[1]["tok_s"] and rows[1]["on_off"] is None
    assert rows[0]["seqs_per_forward"] == 1.0 and rows[2]["seqs_per_forward"] > 1.0  # 4 clients share forwards
    assert len(made) == 2  # a fresh draft for each speculative run, shared by its warm-up
    assert "vs 1 client(s)" in table(rows)
    with pytest.raises(ValueError, match="40 prompts are too few: the levels need 48"):
        run_levels(eng, draft, ids, [16], 2, 6, (True, False), log=lambda s: None)


def test_a_run_never_reuses_the_prompts_its_level_s_other_run_left_in_the_slots():
    """Speculation on, then off, on the same prompts with prefix reuse: each run takes from the
    slots the prefix its own requests share (a system turn), never the other run's whole prompts,
    so both compute the same prompt tokens (the second run once found every prompt cached)."""
    target = build_tiny_llama(seed=3, num_layers=2, max_positions=128)
    target.config.eos_token_id = None
    eng = SpecEngine(target, build_draft("truncate:1", target),
                     options=small_options(k=2, max_seq_len=128, max_concurrency=8, k_policy="fixed",
                                           prefix_reuse=True))
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, 256, (12,), generator=gen).tolist()
    ids = [system + torch.randint(0, 256, (6,), generator=gen).tolist() for _ in range(3)]
    rows = run_levels(eng, lambda e: e.make_draft(build_draft("truncate:1", target)), ids, [1], 2, 4, (True, False),
                      log=lambda s: None)
    shares = [r["cached_share"] for r in rows]
    assert shares[0] == shares[1] and 0.3 < shares[0] < 0.9  # the system turn only, in both runs


def test_a_draft_that_reads_features_reuses_prefixes_as_plain_requests_do():
    """A head takes a held prefix only where its own draft object left it: the run's warm-up
    and timed rounds share one draft, so the timed requests reuse the system turn the warm-up
    left in the slots as plain requests do (a fresh draft for the timed round could not)."""
    from infra.drafts.head import build_head
    from infra.drafts.spec import DraftSpec

    target = build_tiny_llama(seed=3, num_layers=2, max_positions=128)
    target.config.eos_token_id = None
    head = lambda: build_head(target, DraftSpec(family="head", feature_layers=(0, 1), draft_vocab=64))  # noqa: E731
    eng = SpecEngine(target, head(), options=small_options(k=2, max_seq_len=128, max_concurrency=8, k_policy="fixed",
                                                           prefix_reuse=True))
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, 256, (12,), generator=gen).tolist()
    ids = [system + torch.randint(0, 256, (6,), generator=gen).tolist() for _ in range(3)]
    made = []

    def draft(e):
        made.append(e.make_draft(head()))
        return made[-1]

    rows = run_levels(eng, draft, ids, [1], 2, 4, (True, False), log=lambda s: None)
    shares = [r["cached_share"] for r in rows]
    # the head computes its prefix's last position again (its features are the next row's input):
    # one token a prompt less than plain requests take (it took 0.31 against 0.67 with a fresh draft)
    assert len(made) == 1 and shares[0] == pytest.approx(shares[1] - 1 / 18) and 0.3 < shares[1] < 0.9


def test_conversations_send_each_turn_after_the_answer_and_reuse_is_compared_on_the_same_requests():
    """--workload multiturn, --prefix-reuse both: each second turn goes out after the engine's
    answer to the first and takes that exchange from a slot; the engine without reuse serves
    the same requests and computes every prompt token."""
    from infra.target import tiny_tokenizer

    target = build_tiny_llama(seed=3, num_layers=2, max_positions=256)
    target.config.eos_token_id = None
    tok = tiny_tokenizer()
    engines = {r: SpecEngine(target, None, tok, small_options(k=2, max_seq_len=256, max_concurrency=2,
                                                               prefix_reuse=r == "on"))
               for r in ("on", "off")}
    convs = [(f"question {i} about a topic", f"and a follow-up {i}") for i in range(12)]
    rows = run_levels(None, None, convs, [1, 2], 2, 5, (False,), log=lambda s: None, engines=engines, tokenizer=tok)
    assert [(r["clients"], r["prefix_reuse"]) for r in rows] == [(1, "on"), (1, "off"), (2, "off"), (2, "on")]
    assert all(0 < r["tokens"] <= 2 * 5 * r["requests"] and len(r["ttft_ms"]) == 2 for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[2]["tokens"] == rows[3]["tokens"]  # the same answers
    on = [r["cached_share"] for r in rows if r["prefix_reuse"] == "on"]
    assert all(share > 0.3 for share in on) and all(r["cached_share"] == 0 for r in rows if r["prefix_reuse"] == "off")
    assert "prompt cached" in table(rows)


def test_the_default_levels_find_enough_sharegpt_prompts():
    """Without --prompts-file every held-out first turn is a candidate (it once took 32, and the
    default levels 1,8,16 with 2 requests need 75), and every one fits the context."""
    from infra.config import OSDConfig
    from infra.target import tiny_tokenizer
    from pipeline.bench.batch import _items

    args = build_parser().parse_args(["bench", "batch"])
    items = _items(OSDConfig(), args, tiny_tokenizer(), 2048)
    assert len(items) >= sum(args.clients) * (args.requests + 1)
    assert all(len(x) + args.max_new_tokens <= 2048 for x in items)
