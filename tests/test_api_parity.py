"""The request parser against OpenAI's schemas, field by field, without a server (issue 30).

Every field in serve/api/params.py's tables is refused, naming itself, at any value but its
neutral one; every declared field takes an explicit null as its default; the chat template
gets what OpenAI's message forms mean.
"""

import json
from types import SimpleNamespace

import pytest

from infra.target import tiny_tokenizer
from serve.engine.admission import retry_after_s
from serve.api.params import UNSUPPORTED
from serve.api.chat_template import chat_prompt_ids
from serve.engine.errors import RequestError
from serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request

pytestmark = pytest.mark.pure

KINDS = {"chat": ChatCompletionRequest, "completion": CompletionRequest}
BASE = {"chat": {"messages": [{"role": "user", "content": "x"}]}, "completion": {"prompt": "x"}}
# Values to try as "not neutral": each field refuses at least one of them.
CANDIDATES = [True, 1.5, 3, {"type": "json_object"}, {"x": 1}, ["x", "y"], "required", "x"]


def parse(kind, **fields):
    return parse_request(KINDS[kind], json.dumps({**BASE[kind], **fields}).encode(), 64)


TABLE = [(kind, name) for kind, fields in UNSUPPORTED.items() for name in fields]


@pytest.mark.parametrize("kind,name", TABLE, ids=[f"{k}-{n}" for k, n in TABLE])
def test_unsupported_field_is_refused_by_name_and_null_accepted(kind, name):
    neutral, why = UNSUPPORTED[kind][name]
    value = next(v for v in CANDIDATES if not neutral(v))
    with pytest.raises(APIError) as e:
        parse(kind, **{name: value})
    assert e.value.status == 400 and e.value.param == name and e.value.code == "unsupported_parameter"
    assert why in e.value.message
    parse(kind, **{name: None})  # null: the default, accepted


@pytest.mark.parametrize("kind", KINDS)
def test_every_declared_field_takes_null_as_its_default(kind):
    model = KINDS[kind]
    defaults = {n: f.default for n, f in model.model_fields.items() if not f.is_required()}
    req = parse(kind, **dict.fromkeys(defaults))
    for name, default in defaults.items():
        assert getattr(req, name) == default, name


def test_stream_options_need_stream_and_refuse_obfuscation():
    with pytest.raises(APIError) as e:
        parse("chat", stream_options={"include_usage": True})
    assert e.value.param == "stream_options"
    assert parse("chat", stream=True, stream_options={"include_usage": True}).include_usage()
    with pytest.raises(APIError) as e:
        parse("chat", stream=True, stream_options={"include_obfuscation": True})
    assert e.value.param == "stream_options.include_obfuscation"


def test_content_parts_flatten_to_one_string():
    msgs = [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": "no"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "still no"}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    req = parse("chat", messages=msgs)
    assert req.flat_messages() == [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "no"},
                                   {"role": "assistant", "content": "still no"},
                                   {"role": "tool", "content": "42", "tool_call_id": "c1"}]


@pytest.mark.parametrize("content,param", [
    ([{"type": "input_audio", "input_audio": {}}], "messages.0.content.0.type"),
    (["just a string"], "messages.0.content.0.type"),
    ([{"type": "text", "text": 5}], "messages.0.content.0.text"),
    (5, "messages.0.content"),
    (None, "messages.0.content"),
])
def test_bad_content_is_a_400_naming_it(content, param):
    with pytest.raises(APIError) as e:
        parse("chat", messages=[{"role": "user", "content": content}])
    assert e.value.status == 400 and e.value.param == param


def test_function_role_and_assistant_audio_are_refused():
    with pytest.raises(APIError) as e:
        parse("chat", messages=[{"role": "function", "content": "x", "name": "f"}])
    assert e.value.param == "messages.0.role"
    with pytest.raises(APIError) as e:
        parse("chat", messages=[{"role": "assistant", "content": None, "audio": {"id": "a"}}])
    assert e.value.param == "messages.0.audio"


@pytest.mark.parametrize("prompt,taken", [("text", "text"), (["text"], "text"), ([1, 2], [1, 2]), ([[1, 2]], [1, 2])])
def test_one_prompt_in_any_of_its_forms(prompt, taken):
    assert parse("completion", prompt=prompt).prompt == taken


@pytest.mark.parametrize("prompt,needle", [
    (["a", "b"], "batch of 2 prompts"), ([[1], [2], [3]], "batch of 3 prompts"), ([], "token ids"),
    ([True], "token ids"), ([-1], "token ids"), (5, "string or a list"), ({"a": 1}, "string or a list"),
])
def test_bad_prompts_are_400s_with_a_plain_message(prompt, needle):
    with pytest.raises(APIError) as e:
        parse("completion", prompt=prompt)
    assert e.value.param == "prompt" and needle in e.value.message and "prompt.str" not in e.value.message


def test_continue_final_message_needs_an_assistant_last_and_no_generation_prompt():
    assistant_last = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert parse("chat", messages=assistant_last, add_generation_prompt=False, continue_final_message=True)
    for fields in ({"messages": assistant_last, "continue_final_message": True},
                   {"add_generation_prompt": False, "continue_final_message": True}):
        with pytest.raises(APIError) as e:
            parse("chat", **fields)
        assert e.value.param == "continue_final_message"


# ---------------------------------------------------------------- processors and log-probs

def test_processor_fields_reach_the_engine_request_as_given():
    req = parse("chat", presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.2, min_tokens=3,
                logit_bias={"10": 5, " 7": -100}, ignore_eos=True, max_tokens=8)
    assert req.processors() == {"presence_penalty": 0.5, "frequency_penalty": -1.5, "repetition_penalty": 1.2,
                                "min_tokens": 3, "logit_bias": [[10, 5.0], [7, -100.0]]}
    assert req.ignore_eos and req.top_logprobs_n() is None
    assert parse("completion", stop_token_ids=[3, 4]).stop_token_ids == [3, 4]
    assert parse("chat", logprobs=True).top_logprobs_n() == 0
    assert parse("chat", logprobs=True, top_logprobs=5).top_logprobs_n() == 5
    assert parse("completion", logprobs=0).top_logprobs_n() == 0
    assert parse("completion", logprobs=3).top_logprobs_n() == 3


@pytest.mark.parametrize("kind,fields,param", [
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": -1}, "repetition_penalty"),
    ("chat", {"repetition_penalty": float("inf")}, "repetition_penalty"),
    ("chat", {"presence_penalty": float("nan")}, "presence_penalty"),
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": "high"}}, "logit_bias.5"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("completion", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat", {"stop_token_ids": "5"}, "stop_token_ids"),
    ("chat", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 33}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("completion", {"logprobs": 33}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"logprobs": 2, "echo": True}, "logprobs"),
])
def test_bad_processor_and_logprob_values_are_400s_naming_the_field(kind, fields, param):
    with pytest.raises(APIError) as e:
        parse_request(KINDS[kind], json.dumps({**BASE[kind], **fields}).encode(), 64, 32)
    assert e.value.status == 400 and e.value.param.startswith(param), (e.value.param, e.value.message)


def test_logprobs_up_to_the_capture_top_k_are_accepted():
    body = json.dumps({**BASE["chat"], "logprobs": True, "top_logprobs": 32}).encode()
    assert parse_request(ChatCompletionRequest, body, 64, 32).top_logprobs_n() == 32


def test_logprob_shapes_are_openais():
    from serve.api.openai_protocol import chat_body, completion_chunk, completion_logprobs

    entries = [{"token": "hé", "logprob": -0.5, "top": [["hé", -0.5], ["a", -1.5]]},
               {"token": "!", "logprob": float("-inf"), "top": [["x", -0.1]]}]
    result = {"text": "hé!", "finish_reason": "length", "usage": {}, "logprobs": entries,
              **dict.fromkeys(["draft_version", "acceptance_rate", "mean_accepted_len", "num_drafts",
                               "num_draft_tokens", "num_accepted_tokens", "record_id"])}
    content = chat_body("id", "m", result)["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "hé", "logprob": -0.5, "bytes": [104, 195, 169],
                          "top_logprobs": [{"token": "hé", "logprob": -0.5, "bytes": [104, 195, 169]},
                                           {"token": "a", "logprob": -1.5, "bytes": [97]}]}
    assert content[1]["logprob"] == -9999.0  # JSON has no -inf (vLLM's floor)
    legacy = completion_logprobs(entries, offset=4)
    assert legacy == {"tokens": ["hé", "!"], "token_logprobs": [-0.5, -9999.0],
                      "top_logprobs": [{"hé": -0.5, "a": -1.5}, {"x": -0.1, "!": -9999.0}], "text_offset": [4, 6]}
    chunk = json.loads(completion_chunk("id", "m", 0, "hé!", logprobs=legacy)[len("data: "):])
    assert chunk["choices"][0]["logprobs"] == legacy


# ---------------------------------------------------------------- the chat template

def test_developer_renders_as_system_unless_the_template_knows_it():
    tok = tiny_tokenizer()
    dev = chat_prompt_ids(tok, [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}])
    sys_ = chat_prompt_ids(tok, [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}])
    assert dev == sys_
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}{# developer #}"
    assert tok.decode(chat_prompt_ids(tok, [{"role": "developer", "content": "d"}])) == "developer:d;"


def test_generation_prompt_and_continuing_the_last_message():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "partial"}]
    cont = tok.decode(chat_prompt_ids(tok, msgs, add_generation_prompt=False, continue_final_message=True))
    assert cont.endswith("partial")
    assert tok.decode(chat_prompt_ids(tok, msgs[:1])).endswith("<|im_start|>assistant\n")


def test_tool_calls_a_template_cannot_show_are_refused_and_template_errors_are_request_errors():
    tok = tiny_tokenizer()
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(RequestError, match="tool_calls"):
        chat_prompt_ids(tok, [{"role": "assistant", "content": "", "tool_calls": calls}])
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(RequestError, match="roles must alternate"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- Retry-After

@pytest.mark.parametrize("queued,total,service_s,expect", [(0, 2, 5.0, 1), (4, 2, 1.5, 3), (1, 2, 0.2, 1),
                                                          (16, 2, 2.0, 16)])
def test_retry_after_is_the_queue_ahead_at_the_completion_rate(queued, total, service_s, expect):
    assert retry_after_s(SimpleNamespace(queued=queued, total=total), service_s) == expect
