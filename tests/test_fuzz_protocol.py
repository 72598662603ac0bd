"""Property tests of the request parser: whatever bytes a client sends, the answer is a 4xx.

`serve.openai_api.parse_request` is the one gate between the network and the replica. Its
contract: return a request the replica can run, or raise APIError with a 4xx status. Any
other exception (RecursionError, UnicodeEncodeError, OverflowError later in the replica)
is a 500 to the client. Hypothesis drives it with arbitrary bytes, arbitrary JSON values and
bodies of the right shape holding hostile values; the inputs known to reach a 500 today
(seed 10^26 / 2^64 / -2^63-1, a lone surrogate, 100,000-deep nesting) are pinned as
explicit cases so they run on every seed.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

pytestmark = pytest.mark.pure

MAX_NEW = 64
KINDS = [ChatCompletionRequest, CompletionRequest]
# No example database: it would write .hypothesis/ into the work tree. No deadline: tests
# assert behaviour, never timings (a 100,000-deep body is slow to build on a busy machine).
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Seeds that overflow torch.Generator.manual_seed, which accepts [-2^63, 2^64).
BAD_SEEDS = [10**26, 2**64, -(2**63) - 1]
DEEP = 100_000


def deep_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def accepted_is_runnable(req) -> None:
    """What the replica does with an accepted request must not raise: seed the sampler and
    UTF-8-encode every string for the tokenizer."""
    if req.seed is not None:
        torch.Generator().manual_seed(req.seed)
    texts = list(req.stop_list())
    if isinstance(req, ChatCompletionRequest):
        texts += [m["content"] for m in req.flat_messages()]
    elif isinstance(req.prompt, str):
        texts.append(req.prompt)
    for t in texts:
        t.encode("utf-8")


def outcome(kind, raw: bytes):
    """The parser's answer to `raw`: the request, or None after checking the 4xx error.
    Any exception other than APIError propagates and fails the test."""
    try:
        req = parse_request(kind, raw, MAX_NEW)
    except APIError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        body = e.body()["error"]
        assert body["message"] and body["type"]
        return None
    accepted_is_runnable(req)
    return req


# -- strategies -------------------------------------------------------------------------

# Ordinary characters and lone UTF-16 surrogates (which json.loads produces from "\ud800").
any_text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=20)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), any_text,
                    st.sampled_from(BAD_SEEDS))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=16)
# Nested arrays as raw JSON text, from shallow to far past Python's recursion limit.
nested_text = st.integers(1, 200_000).map(deep_array)

ROLES = ["system", "user", "assistant"]
plain_text = st.text(max_size=40)  # st.text excludes surrogates by default
valid_common = {
    "max_tokens": st.integers(1, MAX_NEW),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.0, 1.0, exclude_min=True),
    "top_k": st.integers(-1, 1000),
    "seed": st.integers(0, 2**32 - 1),
    "stop": st.one_of(plain_text, st.lists(plain_text, max_size=4)),
    "stream": st.booleans(),
    "model": st.sampled_from(["osd", "tiny-random"]),
}
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": plain_text}),
                          min_size=1, max_size=4)
valid_chat = st.fixed_dictionaries({"messages": valid_messages}, optional=valid_common)
valid_completion = st.fixed_dictionaries(
    {"prompt": st.one_of(plain_text.filter(bool), st.lists(st.integers(0, 255), min_size=1, max_size=16))},
    optional=valid_common)

# Hostile values per field: wrong types, out-of-range numbers, lone surrogates.
hostile_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES), json_values),
                                         "content": st.one_of(any_text, json_values)})
hostile_common = {
    **{name: json_values for name in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "n",
                                      "osd_record", "osd_speculate", "max_completion_tokens")},
    "seed": st.one_of(st.integers(), st.sampled_from(BAD_SEEDS), json_values),
    "stop": st.one_of(any_text, st.lists(any_text, max_size=6), json_values),
}
hostile_chat = {**hostile_common, "messages": st.one_of(st.lists(hostile_message, max_size=4), json_values)}
hostile_completion = {**hostile_common,
                      "prompt": st.one_of(any_text, st.lists(st.integers(), max_size=8), json_values)}


def mutated(valid: st.SearchStrategy, hostile: dict) -> st.SearchStrategy:
    """A valid body with one to three fields replaced by hostile values. Mostly-valid bodies
    get past the type checks, so the hostile value is the one the parser has to judge."""
    def one_field(name: str) -> st.SearchStrategy:
        return hostile[name].map(lambda v: (name, v))

    edits = st.lists(st.sampled_from(sorted(hostile)).flatmap(one_field), min_size=1, max_size=3)
    return st.tuples(valid, edits).map(lambda pair: {**pair[0], **dict(pair[1])})


chat_bodies = mutated(valid_chat, hostile_chat)
completion_bodies = mutated(valid_completion, hostile_completion)


def with_nested_field(body: dict, field: str, depth: int) -> bytes:
    """`body` as JSON with `field` replaced by `depth` nested arrays (built as text: the json
    module cannot serialise what it cannot parse)."""
    marker = "__nested_marker__"
    text = json.dumps({**body, field: marker})
    return text.replace(json.dumps(marker), deep_array(depth)).encode()


# -- never anything but a 4xx ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(raw=st.binary(max_size=200))
@example(raw=b"\xff\xfe")
def test_arbitrary_bytes_get_a_4xx_or_a_request(kind, raw):
    outcome(kind, raw)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(value=json_values)
def test_arbitrary_json_values_get_a_4xx_or_a_request(kind, value):
    outcome(kind, json.dumps(value).encode())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(raw=nested_text)
def test_nested_arrays_of_any_depth_get_a_4xx(kind, raw):
    outcome(kind, raw.encode())


@FUZZ
@given(body=chat_bodies, ascii_only=st.booleans())
def test_chat_bodies_of_any_shape_get_a_4xx_or_a_runnable_request(body, ascii_only):
    # ensure_ascii=False + surrogatepass puts a lone surrogate on the wire as raw (invalid) UTF-8.
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    outcome(ChatCompletionRequest, raw)


@FUZZ
@given(body=completion_bodies, ascii_only=st.booleans())
def test_completion_bodies_of_any_shape_get_a_4xx_or_a_runnable_request(body, ascii_only):
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    outcome(CompletionRequest, raw)


@FUZZ
@given(field=st.sampled_from(["messages", "stop", "seed", "model", "osd_record"]), depth=st.integers(1, 200_000))
def test_deep_nesting_in_any_field_gets_a_4xx(field, depth):
    body = {"messages": [{"role": "user", "content": "x"}]}
    outcome(ChatCompletionRequest, with_nested_field(body, field, depth))


# -- the inputs known to reach a 500 through today's server, pinned ----------------------------

PINNED = {
    **{f"seed={s}": (ChatCompletionRequest,
                     json.dumps({"messages": [{"role": "user", "content": "x"}], "seed": s,
                                 "temperature": 1.0}).encode()) for s in BAD_SEEDS},
    "completion seed=2^64": (CompletionRequest, json.dumps({"prompt": "x", "seed": 2**64}).encode()),
    "lone surrogate in content": (ChatCompletionRequest,
                                  b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    "lone surrogate in stop": (ChatCompletionRequest,
                               b'{"messages": [{"role": "user", "content": "x"}], "stop": "\\udfff"}'),
    "lone surrogate in prompt": (CompletionRequest, b'{"prompt": "\\ud800"}'),
    "100,000-deep body": (ChatCompletionRequest, deep_array(DEEP).encode()),
    "100,000-deep field": (ChatCompletionRequest,
                           with_nested_field({"messages": [{"role": "user", "content": "x"}]}, "stop", DEEP)),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_known_hostile_inputs_get_a_4xx(name):
    kind, raw = PINNED[name]
    with pytest.raises(APIError) as e:
        parse_request(kind, raw, MAX_NEW)
    assert 400 <= e.value.status < 500


# -- valid bodies are accepted as sent ------------------------------------------------------


def assert_fields_kept(req, body: dict) -> None:
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "model"):
        if name in body:
            assert getattr(req, name) == body[name], name


@FUZZ
@given(body=valid_chat)
def test_valid_chat_bodies_are_accepted_as_sent(body):
    req = outcome(ChatCompletionRequest, json.dumps(body).encode())
    assert req is not None
    assert req.flat_messages() == body["messages"]  # what the chat template gets
    assert_fields_kept(req, body)


@FUZZ
@given(body=valid_completion)
def test_valid_completion_bodies_are_accepted_as_sent(body):
    req = outcome(CompletionRequest, json.dumps(body).encode())
    assert req is not None and req.prompt == body["prompt"]
    assert_fields_kept(req, body)
