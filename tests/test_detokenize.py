"""serve/engine/detokenize.py: the incremental text is the full decode after every push, and the first
stop string is the one a search of the full text finds, whatever the token boundaries."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.target import tiny_tokenizer
from serve.engine.detokenize import IncrementalDecoder, StopScanner
from serve.api.openai_protocol import IncrementalText

pytestmark = pytest.mark.pure

PROPS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
TOK = tiny_tokenizer()  # byte-level: a character of 2-4 UTF-8 bytes is 2-4 tokens


def full_decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def first_stop(text, stops):
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


def check_pushes(ids, cuts, stops, tok=TOK):
    """Push ids in the chunks `cuts` marks; after each push compare with the full decode. The
    first stop found stays (the engine ends the request there and pushes nothing more), even
    where later text completes a longer stop string that starts earlier ('010' after '1')."""
    scan = StopScanner(tok, stops)
    bounds = [0, *sorted(set(cuts)), len(ids)]
    want = None
    for a, b in zip(bounds, bounds[1:]):
        scan.push(ids[a:b])
        text = tok.decode(ids[:b], skip_special_tokens=True)
        assert scan.decoder.text == text
        assert len(scan.decoder) == len(text)
        want = first_stop(text, stops) if want is None else want
        assert scan.stop_at == want
    return scan


def test_multibyte_characters_and_a_stop_string_spanning_tokens():
    text = "héllo wörld € 😀 日本語 end€😀 tail"
    ids = TOK.encode(text, add_special_tokens=False)
    stops = ("zzz", "€😀", "日本")
    scan = check_pushes(ids, range(1, len(ids)), stops)  # one token per push
    assert scan.stop_at == text.find("日本")  # "€" alone appears earlier: only whole stops count
    assert scan.text_before_stop() == text[: text.find("日本")]
    check_pushes(ids, range(0, len(ids), 3), stops)  # three per push: cuts fall inside characters


def test_a_character_cut_between_tokens_reads_as_replacement_until_complete():
    ids = TOK.encode("é!", add_special_tokens=False)
    dec = IncrementalDecoder(TOK)
    dec.push(ids[:1])
    assert dec.text == full_decode(ids[:1]) and dec.text.endswith("\ufffd")
    dec.push(ids[1:])
    assert dec.text == "é!"


def test_special_tokens_between_the_bytes_of_a_character_are_skipped_as_in_a_full_decode():
    e = TOK.encode("€", add_special_tokens=False)
    ids = [*e[:1], TOK.eos_token_id, *e[1:], TOK.eos_token_id]
    check_pushes(ids, range(1, len(ids)), ("€",))


@PROPS
@given(st.text(max_size=40), st.data())
def test_incremental_equals_full_decode_for_any_text_and_cuts(text, data):
    ids = TOK.encode(text, add_special_tokens=False)
    if ids:
        ids.insert(data.draw(st.integers(0, len(ids))), TOK.eos_token_id)  # skipped by both
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=10))
    stops = data.draw(st.lists(st.text(max_size=3), max_size=3))
    if text:  # a stop that occurs, so the search is exercised
        i = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[i: i + data.draw(st.integers(1, 4))])
    check_pushes(ids, cuts, tuple(stops))


def test_each_push_decodes_only_recent_tokens():
    """The decode work stays linear in the output: no push decodes the whole output again."""
    decoded = []

    class Counting:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens):
            decoded.append(len(ids))
            return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = TOK.encode("ab€ " * 200, add_special_tokens=False)
    scan = StopScanner(Counting(), ("never",))
    for t in ids:
        scan.push([t])
    assert scan.decoder.text == full_decode(ids) and scan.stop_at is None
    assert max(decoded) <= 8 and sum(decoded) <= 4 * len(ids)


class Wrapped:
    """The byte-level tokenizer with a rewrite of the decoded text, as other tokenizers do."""

    def __init__(self, rewrite, clean_up_tokenization_spaces=False):
        self.rewrite, self.clean_up_tokenization_spaces = rewrite, clean_up_tokenization_spaces

    def decode(self, ids, skip_special_tokens):
        return self.rewrite(TOK.decode(ids, skip_special_tokens=skip_special_tokens))


def cleanup(text):
    return text.replace(" .", ".").replace(" ,", ",")


@pytest.mark.parametrize("tok", [
    Wrapped(lambda t: t.removeprefix(" ")),  # SentencePiece: a text's leading space is dropped
    Wrapped(cleanup, clean_up_tokenization_spaces=True),  # says it rewrites: decoded whole
    Wrapped(cleanup),  # rewrites without saying so: found out when the context's text changes
], ids=["leading-space", "cleanup-declared", "cleanup-undeclared"])
def test_tokenizers_that_rewrite_text_still_give_the_full_decode(tok):
    ids = TOK.encode(" a . b , c  .d €, é .", add_special_tokens=False)
    check_pushes(ids, range(1, len(ids)), (". b", "c."), tok=tok)
    check_pushes(ids, range(0, len(ids), 2), ("d €,",), tok=tok)


def test_streamed_deltas_add_up_to_the_text_cut_at_the_stop():
    text = "naïve café €5 — done"
    ids = TOK.encode(text, add_special_tokens=False)
    stop = "€5"
    cut = text.find(stop)
    inc = IncrementalText(TOK, (stop,))
    sent = ""
    for i, t in enumerate(ids):
        sent += inc.push([t])
        assert "\ufffd" not in sent and text.startswith(sent)
        if len(TOK.decode(ids[: i + 1])) >= cut + len(stop):
            break  # where the engine stops
    assert sent == text[:cut]
    assert sent + inc.finish(text[:cut]) == text[:cut]


def test_the_first_stop_found_stays_when_a_longer_one_completes_earlier_later():
    """Found by the property test: '1' ends the request after "01"; the '010' that the next
    token would complete never gets to count (the engine pushes nothing after a stop)."""
    ids = TOK.encode("010", add_special_tokens=False)
    scan = check_pushes(ids, [2], ("010", "1"))
    assert scan.stop_at == 1 and scan.text_before_stop() == "0"
    assert check_pushes(ids, [], ("010", "1")).stop_at == 0  # all at once: the earlier start wins
