import json

import pytest

from infra.target import tiny_tokenizer
from serve.api.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    IncrementalText,
    chat_chunk,
    parse_request,
    record_choice,
)

pytestmark = pytest.mark.pure


def test_parse_ok_and_defaults():
    req = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], "foo": 1}', 64)
    assert req.temperature == 1.0 and req.token_budget() is None and req.stop_list() == ()
    c = parse_request(CompletionRequest, b'{"prompt": "x", "stop": "\\n"}', 64)
    assert c.max_tokens == 16 and c.stop_list() == ("\n",)


@pytest.mark.parametrize(
    "raw,param",
    [
        (b"\xff\xfe", None),
        (b'"just a string"', None),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 65}', "max_completion_tokens"),
        (b'{"prompt": "x"}', "messages"),
    ],
)
def test_parse_errors_are_400(raw, param):
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, raw, 64)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_incremental_text_never_sends_any_part_of_a_stop_string():
    tok = tiny_tokenizer()
    ids = tok.encode("hello world", add_special_tokens=False)
    inc = IncrementalText(tok, stops=("wor",))
    chunks = [inc.push([i]) for i in ids[: len("hello wor")]]  # the engine stops on the "r"
    sent = "".join(chunks)
    assert sent == "hello "  # "w" and "wo" could still have become "wor": held back
    final = "hello "  # what the engine returns, cut at the stop string
    assert sent + inc.finish(final) == final


def test_incremental_text_without_stops_sends_everything():
    tok = tiny_tokenizer()
    inc = IncrementalText(tok)
    text = "plain text"
    sent = "".join(inc.push([i]) for i in tok.encode(text, add_special_tokens=False))
    assert sent == text and inc.finish(text) == ""


def test_incremental_text_never_splits_a_multibyte_character():
    tok = tiny_tokenizer()
    ids = tok.encode("é!", add_special_tokens=False)  # two byte tokens for é, then !
    assert len(ids) == 3
    inc = IncrementalText(tok)
    assert inc.push(ids[:1]) == ""  # half a character: nothing sent yet
    assert inc.push(ids[1:2]) == "é"
    assert inc.push(ids[2:]) == "!"
    assert inc.finish("é!") == ""


def test_chat_chunk_is_sse():
    line = chat_chunk("req-1", "m", 1, {"content": "x"}, "stop", extra={"usage": {"total_tokens": 3}})
    assert line.startswith("data: ") and line.endswith("\n\n")
    body = json.loads(line[len("data: "):])
    assert body["choices"][0] == {"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}
    assert body["usage"] == {"total_tokens": 3}


@pytest.mark.parametrize("osd_record,store,header,want", [
    (None, None, None, None),  # nothing said: the server's setting
    (True, None, None, True),
    (None, True, None, None),  # store: true keeps the default
    (None, True, "on", True),  # the header's "on" opts in (a default-off tenant records it)
    (None, None, " On ", True),
    (False, None, None, False),
    (None, False, None, False),
    (True, False, None, False),  # any opt-out wins over osd_record: true
    (True, None, "off", False),
    (None, None, "FALSE", False),
    (None, None, " 0 ", False),
])
def test_record_choice_any_opt_out_stops_the_record(osd_record, store, header, want):
    assert record_choice(osd_record, store, header) is want


@pytest.mark.parametrize("header", ["no", "", "1", "true", "of"])
def test_record_choice_refuses_an_unknown_header_value_naming_the_header(header):
    with pytest.raises(APIError) as e:
        record_choice(None, None, header)
    assert e.value.status == 400 and e.value.param == "X-OSD-Record" and "X-OSD-Record" in e.value.message


@pytest.mark.parametrize("kind,body", [(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]'),
                                       (CompletionRequest, b'{"prompt": "x"')])
def test_store_is_parsed_on_both_routes(kind, body):
    assert parse_request(kind, body + b', "store": false}', 64).store is False
    assert parse_request(kind, body + b', "store": true}', 64).store is True
    assert parse_request(kind, body + b'}', 64).store is None
