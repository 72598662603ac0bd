import pytest

from infra.config import DataConfig
from infra.prompts import (
    PromptDataError,
    chat_ids,
    conversation_root,
    domain_of,
    iter_json_array,
    load_jsonl,
    load_sharegpt,
    messages_ids,
    sharegpt_conversations,
    sharegpt_second_turns,
    split_of,
)

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def sharegpt():
    return sharegpt_conversations()


def test_truncated_array_keeps_complete_records():
    text = '[{"id": "a", "v": [1, 2]}, {"id": "b"},\n {"id": "c", "conversations": [{"from": "hu'
    assert [r["id"] for r in iter_json_array(text)] == ["a", "b"]
    assert list(iter_json_array("[]")) == []
    with pytest.raises(PromptDataError):
        list(iter_json_array('{"not": "an array"}'))


def test_sharegpt_has_all_complete_conversations(sharegpt):
    assert len(sharegpt) >= 17_000
    # The last kept record is whole: it has an id and a human turn.
    assert isinstance(sharegpt[-1]["id"], str)


def test_sharegpt_prompts_filters_and_tags(sharegpt):
    cfg = DataConfig(max_prompt_chars=500)
    prompts = load_sharegpt(cfg)
    assert prompts and all(0 < len(p.text) <= 500 for p in prompts)
    assert {p.domain for p in prompts} == {"code", "math", "writing", "other"}
    assert len(prompts) < len(sharegpt)


def test_split_is_deterministic_and_keeps_chat_parts_together():
    cfg = DataConfig()
    a = [(p.id, p.split) for p in load_sharegpt(cfg)]
    b = [(p.id, p.split) for p in load_sharegpt(cfg)]
    assert a == b
    held = sum(s == "held_out" for _, s in a) / len(a)
    assert 0.03 < held < 0.07  # held_out_fraction 0.05
    assert conversation_root("QWJhYvA_12") == "QWJhYvA"
    assert split_of("QWJhYvA_0", 0.5) == split_of("QWJhYvA_7", 0.5)
    # Only-held-out view matches the full list's held-out part.
    held_ids = [p.id for p in load_sharegpt(cfg, split="held_out")]
    assert held_ids == [i for i, s in a if s == "held_out"]


@pytest.mark.parametrize(
    "text,domain",
    [
        ("Fix this python function that throws an exception", "code"),
        ("```\nfoo()\n```", "code"),
        ("What is 12 * 7?", "math"),
        ("Solve the equation for x", "math"),
        ("Write a short poem about autumn", "writing"),
        ("Who was the first emperor of Rome?", "other"),
    ],
)
def test_domain_rule(text, domain):
    assert domain_of(text) == domain


def test_jsonl_source(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "write a haiku"}\n\n{"prompt": "x", "id": "p2", "domain": "math"}\n')
    ps = load_jsonl(f)
    assert [(p.id, p.text, p.domain) for p in ps] == [("w-1", "write a haiku", "writing"), ("p2", "x", "math")]


@pytest.mark.parametrize(
    "body,match",
    [
        ('{"prompt": "ok"}\n{"prompt": \n', r"w\.jsonl:2: not valid JSON"),
        ('{"text": "no prompt"}\n', r'w\.jsonl:1: expected an object with a string "prompt"'),
        ('{"messages": []}\n', r'w\.jsonl:1: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "robot", "content": "x"}]}\n', r"w\.jsonl:1: messages\[0\] must be"),
        ('{"messages": [{"role": "user", "content": 3}]}\n', r"w\.jsonl:1: messages\[0\] must be"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n',
         r"w\.jsonl:1: the last message must be the user's"),
        ('["prompt"]\n', r"w\.jsonl:1"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, body, match):
    f = tmp_path / "w.jsonl"
    f.write_text(body)
    with pytest.raises(PromptDataError, match=match):
        load_jsonl(f)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(PromptDataError, match="cannot read"):
        load_jsonl(tmp_path / "absent.jsonl")


def test_chat_template_applied(tiny):
    ids = chat_ids(tiny.tokenizer, "hello")
    assert tiny.tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_jsonl_conversations_keep_every_turn(tmp_path, tiny):
    f = tmp_path / "c.jsonl"
    f.write_text('{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, '
                 '{"role": "assistant", "content": "hello"}, {"role": "user", "content": "write a poem"}]}\n'
                 '{"prompt": "one turn"}\n')
    conv, single = load_jsonl(f)
    assert conv.text == "write a poem" and conv.domain == "writing"
    assert [m["role"] for m in conv.chat()] == ["system", "user", "assistant", "user"]
    assert single.chat() == [{"role": "user", "content": "one turn"}] and single.messages == ()
    assert messages_ids(tiny.tokenizer, single.chat()) == chat_ids(tiny.tokenizer, "one turn")


def test_sharegpt_second_turns_are_held_out_pairs_within_the_length_filter():
    cfg = DataConfig()
    convs = sharegpt_second_turns(cfg)
    assert len(convs) > 100
    for cid, turns in convs[:200]:
        assert len(turns) == 2 and all(0 < len(t) <= cfg.max_prompt_chars for t in turns)
        assert split_of(cid) == "held_out"
