"""The real server, driven by the official `openai` SDK as a client of any OpenAI server would.

One Serve application (tiny-random target, truncate:1 draft, API key set) for the module.
Every parameter of the OpenAI chat and completions schemas is honoured or refused with a 400
naming it (issue 30); the refusals are listed in serve/api/params.py.
"""

import threading

import openai
import pytest
import requests
from openai import OpenAI

from apps import running_app

pytestmark = [pytest.mark.ray, pytest.mark.redis]

KEY = "sdk-key"
CAP = 512  # serve.max_new_tokens: above the tiny target's context, so "the rest of the context" shows
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # 2 slots and 1 queue place, so a burst of requests meets a full queue (RateLimitError).
    serve = {"draft": "truncate:1", "max_new_tokens": CAP, "k": 3, "max_concurrency": 2, "max_queue": 1,
             "queue_timeout_s": 20, "k_policy": "fixed", "record": False}
    with running_app(tmp_path_factory.mktemp("sdk"), key=KEY, name="osd-sdk", serve=serve,
                     stream_name="sdk:records") as app:
        yield app


@pytest.fixture(scope="module")
def client(app):
    # No retries: a 429 must reach the test as RateLimitError, not be retried away.
    return OpenAI(base_url=app["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


class _Http:
    """requests with the server's address and key, for vLLM's routes the SDK has no call for."""

    def __init__(self, url: str, key: str | None = KEY):
        self.url, self.headers = url, ({"Authorization": f"Bearer {key}"} if key else {})

    def get(self, path):
        return requests.get(self.url + path, headers=self.headers, timeout=60)

    def post(self, path, json):
        return requests.post(self.url + path, json=json, headers=self.headers, timeout=60)


@pytest.fixture(scope="module")
def http(app):
    return _Http(app["url"])


def user(text):
    return [{"role": "user", "content": text}]


def chat_text(client, messages, **kw):
    r = client.chat.completions.create(model="tiny-random", messages=messages, **{**GREEDY, **kw})
    return r.choices[0].message.content


# ---------------------------------------------------------------- chat

def test_chat_completion_shape(client):
    r = client.chat.completions.create(model="tiny-random", messages=user("hello"), **GREEDY)
    assert r.object == "chat.completion" and r.model == "tiny-random"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_model_alias_osd_is_served(client):
    r = client.chat.completions.create(model="osd", messages=user("alias"), **GREEDY)
    assert r.choices[0].message.content == chat_text(client, user("alias"))


def test_chat_stream_matches_plain_and_sends_no_usage_unasked(client):
    plain = client.chat.completions.create(model="tiny-random", messages=user("a story"), **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny-random", messages=user("a story"), stream=True,
                                                 **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def _counts(usage) -> tuple[int, int, int]:
    """A usage's token counts (its cached prompt tokens depend on what the server held)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_chat_stream_usage_only_in_a_final_chunk_without_choices(client):
    plain = client.chat.completions.create(model="tiny-random", messages=user("usage"), **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny-random", messages=user("usage"), stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert _counts(last.usage) == _counts(plain.usage)
    # The same prompt just served: a KV slot held it (serve/engine/prefix.py).
    assert last.usage.prompt_tokens_details.cached_tokens == last.usage.prompt_tokens - 1
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    """vLLM's option, which guidellm sends: each chunk's usage counts the tokens so far."""
    plain = client.chat.completions.create(model="tiny-random", messages=user("running"), **GREEDY)
    chunks = list(client.chat.completions.create(
        model="tiny-random", messages=user("running"), stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == plain.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == plain.usage.completion_tokens
    assert chunks[-1].choices == []


def test_stream_options_without_stream_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), stream_options={"include_usage": True},
                                       **GREEDY)
    assert e.value.body["param"] == "stream_options"


def test_text_content_parts_equal_a_string(client):
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]
    assert chat_text(client, [{"role": "user", "content": parts}]) == chat_text(client, user("first part\nsecond"))


def test_non_text_content_part_is_a_clear_400(client):
    parts = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": parts}], **GREEDY)
    assert e.value.body["param"] == "messages.0.content.1.type"
    assert "image_url" in e.value.body["message"] and "text" in e.value.body["message"]


def test_developer_role_is_the_system_role(client):
    """The tiny template has no `developer`: it is rendered as OpenAI defines it, a system message."""
    dev = [{"role": "developer", "content": "be brief"}, *user("hi")]
    sys_ = [{"role": "system", "content": "be brief"}, *user("hi")]
    assert chat_text(client, dev) == chat_text(client, sys_)


def test_tool_message_and_null_assistant_content_are_accepted(client):
    msgs = [*user("weather?"), {"role": "assistant", "content": None},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}, *user("so?")]
    r = client.chat.completions.create(model="tiny-random", messages=msgs, **GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_null_content_outside_assistant_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": None}], **GREEDY)
    assert e.value.body["param"] == "messages.0.content"


def test_explicit_nulls_mean_defaults(client):
    kw = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": 7, "max_tokens": 8,
          "extra_body": {"top_k": None}}
    nulls = client.chat.completions.create(model="tiny-random", messages=user("nulls"), **kw)
    defaults = client.chat.completions.create(model="tiny-random", messages=user("nulls"), temperature=1.0,
                                              top_p=1.0, seed=7, max_tokens=8)
    assert nulls.choices[0].message.content == defaults.choices[0].message.content


def test_seed_reproduces_a_sample(client):
    a = chat_text(client, user("seeded"), temperature=1.0, seed=123, max_tokens=12)
    assert a == chat_text(client, user("seeded"), temperature=1.0, seed=123, max_tokens=12)


def test_max_completion_tokens_is_honoured_and_named(client):
    r = client.chat.completions.create(model="tiny-random", messages=user("count"), max_completion_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), max_completion_tokens=CAP + 1)
    assert e.value.body["param"] == "max_completion_tokens"


def test_no_max_tokens_means_the_rest_of_the_context(client, http):
    prompt = "word " * 80
    info = http.post("/tokenize", {"messages": user(prompt)}).json()
    context, prompt_len = info["max_model_len"], info["count"]
    assert prompt_len + 256 > context  # the old fixed default would not fit
    r = client.chat.completions.create(model="tiny-random", messages=user(prompt), temperature=0)
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.completion_tokens <= context - prompt_len
    if r.choices[0].finish_reason == "length":
        assert r.usage.total_tokens == context


def test_stop_string_cuts_the_output(client):
    plain = chat_text(client, user("abc"), max_tokens=30)
    stop = plain[3:5]
    assert stop
    r = client.chat.completions.create(model="tiny-random", messages=user("abc"), stop=[stop], temperature=0,
                                       max_tokens=30)
    assert stop not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert plain.startswith(r.choices[0].message.content)


def test_n_above_one_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), n=2, **GREEDY)
    assert e.value.body["param"] == "n"


# Each parameter the engine cannot honour yet: refused, naming it, never silently ignored.
REFUSED_CHAT = [
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}),
    ("web_search_options", {"web_search_options": {}}),
    ("min_p", {"extra_body": {"min_p": 0.1}}),
    ("guided_json", {"extra_body": {"guided_json": {"type": "object"}}}),
    ("echo", {"extra_body": {"echo": True}}),
    ("chat_template", {"extra_body": {"chat_template": "{{ 'x' }}"}}),
]


@pytest.mark.parametrize("param,kw", REFUSED_CHAT, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REFUSED_CHAT)])
def test_unsupported_chat_parameter_is_a_400_naming_it(client, param, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), **{**GREEDY, **kw})
    assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_parameter"
    assert param in e.value.body["message"]


def test_neutral_values_of_unsupported_parameters_change_nothing(client):
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
               "response_format": {"type": "text"}, "tool_choice": "none", "store": False, "modalities": ["text"],
               "user": "someone", "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": True,
               "extra_body": {"repetition_penalty": 1.0, "ignore_eos": False, "min_tokens": 0}}
    assert chat_text(client, user("neutral"), **neutral) == chat_text(client, user("neutral"))


def test_stream_with_a_bad_parameter_is_an_error_before_any_chunk(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-random", messages=user("x"), stream=True,
                                       response_format={"type": "json_object"}, **GREEDY)


def test_prompt_over_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x" * 600), **GREEDY)
    assert e.value.body["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- completions

def test_completion_shape_and_default_max_tokens(client):
    r = client.completions.create(model="tiny-random", prompt="once upon", temperature=0, max_tokens=None)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.usage.prompt_tokens == len(b"once upon")  # byte-level tiny tokenizer
    assert r.usage.completion_tokens <= 16  # OpenAI's default for completions


def test_completion_stream_matches_plain(client):
    plain = client.completions.create(model="tiny-random", prompt="stream me", **GREEDY)
    chunks = list(client.completions.create(model="tiny-random", prompt="stream me", stream=True, **GREEDY))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_completion_stream_usage_chunk(client):
    plain = client.completions.create(model="tiny-random", prompt="usage", **GREEDY)
    chunks = list(client.completions.create(model="tiny-random", prompt="usage", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(plain.usage)


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="tiny-random", prompt="echo this", **GREEDY).choices[0].text
    echoed = client.completions.create(model="tiny-random", prompt="echo this", echo=True, **GREEDY).choices[0].text
    assert echoed == "echo this" + plain
    streamed = list(client.completions.create(model="tiny-random", prompt="echo this", echo=True, stream=True,
                                              **GREEDY))
    assert streamed[0].choices[0].text == "echo this"
    assert "".join(c.choices[0].text for c in streamed) == echoed


def test_echo_of_a_token_prompt_is_its_text(client, http):
    ids = http.post("/tokenize", {"prompt": "tokens in"}).json()["tokens"]
    plain = client.completions.create(model="tiny-random", prompt=ids, **GREEDY).choices[0].text
    echoed = client.completions.create(model="tiny-random", prompt=ids, echo=True, **GREEDY).choices[0].text
    assert echoed == "tokens in" + plain


def test_prompt_forms_of_one_prompt_agree(client, http):
    ids = http.post("/tokenize", {"prompt": "same"}).json()["tokens"]
    texts = {client.completions.create(model="tiny-random", prompt=p, **GREEDY).choices[0].text
             for p in ("same", ["same"], ids, [ids])}
    assert len(texts) == 1


def test_a_batch_of_prompts_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt=["one", "two"], **GREEDY)
    assert e.value.body["param"] == "prompt"
    assert "batch of 2 prompts" in e.value.body["message"] and "prompt.str" not in e.value.body["message"]


REFUSED_COMPLETION = [
    ("suffix", {"suffix": " end"}),
    ("best_of", {"best_of": 3}),
    ("min_p", {"extra_body": {"min_p": 0.2}}),
    ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}}),
]


@pytest.mark.parametrize("param,kw", REFUSED_COMPLETION, ids=[p for p, _ in REFUSED_COMPLETION])
def test_unsupported_completion_parameter_is_a_400_naming_it(client, param, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", **{**GREEDY, **kw})
    assert e.value.body["param"] == param


def test_completion_neutral_values_are_accepted(client):
    a = client.completions.create(model="tiny-random", prompt="n", logprobs=None, suffix=None, best_of=1,
                                  presence_penalty=0, echo=False, **GREEDY).choices[0].text
    assert a == client.completions.create(model="tiny-random", prompt="n", **GREEDY).choices[0].text


# ---------------------------------------------------------------- log-probs and logits processors

def token_id(http, text):
    (tok,) = http.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return tok


def test_chat_logprobs_are_the_targets_with_or_without_speculation(client):
    kw = dict(logprobs=True, top_logprobs=3, **GREEDY)
    sd = client.chat.completions.create(model="tiny-random", messages=user("log"), **kw)
    ar = client.chat.completions.create(model="tiny-random", messages=user("log"),
                                        extra_body={"osd_speculate": False}, **kw)
    assert sd.model_extra["osd"]["num_draft_tokens"] > 0
    content = sd.choices[0].logprobs.content
    assert len(content) == sd.usage.completion_tokens
    for got, want in zip(content, ar.choices[0].logprobs.content):
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.bytes == list(got.token.encode("utf-8")) and len(got.top_logprobs) == 3
        # greedy with no processors: the emitted token is the most likely one
        assert got.top_logprobs[0].token == got.token and got.top_logprobs[0].logprob == pytest.approx(got.logprob)
        assert [t.logprob for t in got.top_logprobs] == sorted((t.logprob for t in got.top_logprobs), reverse=True)


def test_chat_logprobs_without_top_logprobs_and_off_by_default(client):
    r = client.chat.completions.create(model="tiny-random", messages=user("lp"), logprobs=True, **GREEDY)
    assert all(c.top_logprobs == [] and c.logprob <= 0 for c in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny-random", messages=user("lp"), **GREEDY).choices[0].logprobs is None


def test_streamed_chat_logprobs_equal_the_plain_ones(client):
    kw = dict(logprobs=True, top_logprobs=2, **GREEDY)
    plain = client.chat.completions.create(model="tiny-random", messages=user("stream lp"), **kw)
    chunks = list(client.chat.completions.create(model="tiny-random", messages=user("stream lp"), stream=True, **kw))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    want = plain.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in want]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in want], abs=1e-4)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content


def test_completion_logprobs_shape_and_stream(client):
    plain = client.completions.create(model="tiny-random", prompt="legacy", logprobs=2, **GREEDY)
    lp = plain.choices[0].logprobs
    n = plain.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    # The 2 most likely plus the chosen one, keyed by text (byte tokens cut inside a character share U+FFFD).
    assert all(1 <= len(top) <= 3 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    chunks = list(client.completions.create(model="tiny-random", prompt="legacy", logprobs=2, stream=True, **GREEDY))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_penalties_change_greedy_output_and_stay_lossless(client):
    base = chat_text(client, user("repeat repeat repeat"), max_tokens=24)
    kw = dict(presence_penalty=1.5, frequency_penalty=1.0, max_tokens=24)
    pen = chat_text(client, user("repeat repeat repeat"), **kw)
    assert pen != base
    assert pen == chat_text(client, user("repeat repeat repeat"), extra_body={"osd_speculate": False}, **kw)
    rep = dict(max_tokens=24, extra_body={"repetition_penalty": 1.8})
    rep_sd = chat_text(client, user("repeat repeat repeat"), **rep)
    assert rep_sd != base
    assert rep_sd == chat_text(client, user("repeat repeat repeat"),
                               **{**rep, "extra_body": {"repetition_penalty": 1.8, "osd_speculate": False}})


def test_logit_bias_forces_and_forbids_tokens(client, http):
    a = token_id(http, "a")
    forced = client.completions.create(model="tiny-random", prompt="bias", logit_bias={str(a): 100}, **GREEDY)
    assert forced.choices[0].text == "a" * 8
    plain = client.completions.create(model="tiny-random", prompt="bias", **GREEDY).choices[0].text
    first = token_id(http, plain[0]) if plain and plain[0].isascii() else None
    if first is not None:
        banned = client.completions.create(model="tiny-random", prompt="bias", logit_bias={str(first): -100},
                                           **GREEDY).choices[0].text
        assert not banned.startswith(plain[0])


def test_ignore_eos_and_min_tokens(client, http):
    eos = str(token_id(http, "<|im_end|>"))
    kw = dict(model="tiny-random", messages=user("end"), temperature=0, max_tokens=6, logit_bias={eos: 100})
    stops = client.chat.completions.create(**kw)
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    through = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert through.choices[0].finish_reason == "length" and through.usage.completion_tokens == 6
    held = client.chat.completions.create(**kw, extra_body={"min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_stop_token_ids_end_the_output_and_out_of_vocab_ones_are_400s(client, http):
    a = token_id(http, "a")
    kw = dict(model="tiny-random", prompt="stop ids", logit_bias={str(a): 100}, **GREEDY)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [a]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == ""  # a stop token's text is left out, as vLLM leaves it
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [a], "min_tokens": 2})
    assert held.usage.completion_tokens == 3 and "a" not in held.choices[0].text
    streamed = list(client.completions.create(**kw, stream=True, extra_body={"stop_token_ids": [a], "min_tokens": 2}))
    assert "".join(c.choices[0].text for c in streamed) == held.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", extra_body={"stop_token_ids": [100000]}, **GREEDY)
    assert "stop_token_ids" in e.value.body["message"]


def test_sampling_with_penalties_reproduces_with_a_seed(client):
    kw = dict(temperature=1.0, seed=11, max_tokens=16, presence_penalty=0.5, logit_bias={"40": 2})
    assert chat_text(client, user("seeded"), **kw) == chat_text(client, user("seeded"), **kw)


BAD_VALUES = [
    ("top_logprobs", {"logprobs": True, "top_logprobs": 33}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("logit_bias", {"logit_bias": {"ten": 1}}),
    ("logit_bias", {"logit_bias": {"5": 150}}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("repetition_penalty", {"extra_body": {"repetition_penalty": 0}}),
    ("min_tokens", {"extra_body": {"min_tokens": 9}}),
]


@pytest.mark.parametrize("param,kw", BAD_VALUES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_VALUES)])
def test_bad_processor_values_are_400s_naming_them(client, param, kw):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), **{**GREEDY, **kw})
    assert e.value.body["param"].startswith(param)


def test_out_of_vocab_logit_bias_and_echo_with_logprobs_are_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=user("x"), logit_bias={"100000": 1}, **GREEDY)
    assert "logit_bias" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", echo=True, logprobs=1, **GREEDY)
    assert e.value.body["param"] == "logprobs"


# ---------------------------------------------------------------- models, auth, errors

def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    m = client.models.retrieve("tiny-random")
    assert m.id == "tiny-random" and m.object == "model"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=user("x"), **GREEDY)


def test_wrong_key_is_an_authentication_error(app):
    bad = OpenAI(base_url=app["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny-random", messages=user("x"), **GREEDY)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_a_full_queue_is_a_rate_limit_error_with_a_short_retry_after(client):
    """2 slots and 1 queue place: of 10 requests at once some get 429, and Retry-After estimates the
    queue ahead at the rate requests finish, not their latency with queueing."""
    errors: list = []

    def one(i):
        try:
            client.chat.completions.create(model="tiny-random", messages=user(f"busy {i}"), max_tokens=64,
                                           temperature=0)
        except openai.RateLimitError as e:
            errors.append(e)

    for _ in range(5):  # bounded: a round where every request found room proves nothing
        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            break
    assert errors, "no request was refused with 429"
    e = errors[0]
    assert e.status_code == 429 and e.body["code"] == "overloaded"
    assert 1 <= int(e.response.headers["retry-after"]) <= 10


# ---------------------------------------------------------------- vLLM's extra routes

def test_health_is_open(app):
    assert _Http(app["url"], key=None).get("/health").status_code == 200


def test_version_needs_the_key(app, http):
    assert http.get("/version").json()["version"]
    assert _Http(app["url"], key=None).get("/version").status_code == 401


def test_tokenize_agrees_with_usage(client, http):
    t = http.post("/tokenize", {"prompt": "count me", "return_token_strs": True}).json()
    r = client.completions.create(model="tiny-random", prompt="count me", **GREEDY)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and len(t["token_strs"]) == t["count"]
    c = http.post("/tokenize", {"messages": user("count me")}).json()
    assert c["count"] == client.chat.completions.create(model="tiny-random", messages=user("count me"),
                                                        **GREEDY).usage.prompt_tokens


def test_detokenize_round_trips_and_refuses_bad_ids(http):
    ids = http.post("/tokenize", {"prompt": "round trip é"}).json()["tokens"]
    assert http.post("/detokenize", {"tokens": ids}).json() == {"prompt": "round trip é"}
    bad = http.post("/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_routes_need_the_key(app):
    for path in ("/tokenize", "/detokenize"):
        assert _Http(app["url"], key=None).post(path, {"prompt": "x"}).status_code == 401
