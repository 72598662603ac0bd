"""train/distill/draft_vocab.py: draft vocabularies from token counts and their coverage (pure numpy)."""

import numpy as np
import pytest

from train.distill.draft_vocab import VocabError, coverage, coverage_table, pooled_frequencies, token_counts, top_vocab

pytestmark = pytest.mark.pure


def test_token_counts_count_every_id():
    c = token_counts([[0, 1, 1], np.array([3, 3, 3]), []], 5)
    assert c.tolist() == [1, 2, 0, 3, 0]


def test_top_vocab_takes_the_most_frequent_ids_ascending_ties_to_the_lower_id():
    freq = np.array([5, 1, 5, 9, 0, 1])
    assert top_vocab(freq, 3).tolist() == [0, 2, 3]
    assert top_vocab(freq, 4).tolist() == [0, 1, 2, 3]  # 1 and 5 tie: the lower id wins
    assert top_vocab(freq, 100).tolist() == list(range(6))  # more than V: all of them


def test_coverage_is_the_share_of_counted_tokens_inside():
    counts = np.array([6, 0, 3, 1])
    assert coverage(np.array([0, 2]), counts) == pytest.approx(0.9)
    assert coverage(np.array([1]), counts) == 0.0
    assert coverage(np.array([0]), np.zeros(4, dtype=np.int64)) is None  # nothing to cover


def test_pooling_weights_sources_alike_so_a_small_domain_keeps_its_tokens():
    chat = np.array([1000, 900, 800, 0, 0])  # a big source
    code = np.array([0, 0, 0, 30, 20])  # a small one with its own tokens
    balanced = top_vocab(pooled_frequencies({"chat": chat, "code": code}), 3)
    by_count = top_vocab(pooled_frequencies({"all": chat + code}), 3)
    assert by_count.tolist() == [0, 1, 2]
    assert 3 in balanced.tolist()  # code's most frequent token is in
    assert coverage(balanced, code) > coverage(by_count, code)
    w = pooled_frequencies({"chat": chat, "code": code}, {"chat": 1.0, "code": 0.0})
    assert np.allclose(w, chat / chat.sum())


def test_coverage_table_per_choice_domain_and_size():
    fit = {"chat": np.array([10, 8, 6, 0, 0, 0]), "code": np.array([0, 0, 0, 5, 4, 0])}
    ev = {"chat": np.array([5, 5, 0, 0, 0, 0]), "code": np.array([0, 0, 0, 1, 1, 2])}
    t = coverage_table(fit, ev, sizes=(2, 4))
    assert set(t) == {"balanced", "pooled"} and set(t["balanced"]) == {"chat", "code"}
    assert t["pooled"]["code"][2] == 0.0 and t["balanced"]["code"][2] == pytest.approx(0.5)
    assert t["balanced"]["chat"][4] == 1.0


@pytest.mark.parametrize("call, match", [
    (lambda: token_counts([[0, 7]], 5), "lie in"),
    (lambda: token_counts([[0]], 0), "vocab must be"),
    (lambda: top_vocab(np.array([1, 2, 3]), 1), ">= 2 ids"),
    (lambda: top_vocab(np.array([]), 2), "non-empty"),
    (lambda: coverage(np.array([9]), np.array([1, 2])), "lie in"),
    (lambda: pooled_frequencies({}), "no token sources"),
    (lambda: pooled_frequencies({"a": np.array([1, 2]), "b": np.array([1, 2, 3])}), "different vocabulary"),
    (lambda: pooled_frequencies({"a": np.array([0, 0])}), "a: no tokens"),
    (lambda: pooled_frequencies({"a": np.array([1, -1])}), ">= 0"),
    (lambda: pooled_frequencies({"a": np.array([1, 2])}, {"b": 1.0}), "weights must name"),
    (lambda: coverage_table({"a": np.array([1, 2])}, {"a": np.array([1, 2])}, sizes=(1,)), "sizes"),
    (lambda: coverage_table({"a": np.array([1, 2])}, {"a": np.array([1, 2, 3])}, sizes=(2,)), "shape"),
])
def test_bad_inputs_are_refused_by_name(call, match):
    with pytest.raises(VocabError, match=match):
        call()
