"""Request fields this server does not implement, and the values of each that change nothing.

Every field of the OpenAI chat and completions request schemas (and vLLM's common sampling
extensions) is either a field of the request models in serve/api/openai_protocol.py, and honoured, or
listed here. A listed field is accepted only at its neutral value (`min_p: 0`, `tools: []`,
`response_format: {"type": "text"}`, ...); any other value is a 400 naming it, so no
client gets output that silently ignored what it asked for. Fields in neither place are
unknown and ignored, as OpenAI and vLLM ignore them.
"""

from __future__ import annotations

from typing import Any, Callable


def _null(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _number(neutral: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == neutral)


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


def _text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


def _no_tool_choice(v: Any) -> bool:
    # Only reached with no tools (any tools are refused first): "auto" then calls nothing.
    return v is None or v in ("none", "auto")


def _text_modality(v: Any) -> bool:
    return v is None or v == ["text"]


_ENGINE = "this server's engine does not implement that logits processor"
_LOGPROBS = "prompt log-probabilities are not computed by this server (logprobs of the output are)"
_TOOLS = "this server does not do tool calling"
_GRAMMAR = "constrained decoding is not implemented by this server"
_NO = "this server does not support it"

# name -> (is the value neutral?, why any other value is refused)
_SAMPLING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "min_p": (_number(0), _ENGINE),
    "allowed_token_ids": (_empty, _ENGINE),
    "bad_words": (_empty, _ENGINE),
    "logits_processors": (_empty, _ENGINE),
    "response_format": (_text_format, "constrained (JSON) decoding is not implemented by this server"),
    "structured_outputs": (_empty, _GRAMMAR),
    "guided_json": (_null, _GRAMMAR),
    "guided_regex": (_null, _GRAMMAR),
    "guided_choice": (_null, _GRAMMAR),
    "guided_grammar": (_null, _GRAMMAR),
    "prompt_logprobs": (_null, _LOGPROBS),
    "return_tokens_as_token_ids": (_false, "log-probs always name their tokens as text"),
    "include_stop_str_in_output": (_false, "stop strings are always cut from the output"),
    "skip_special_tokens": (_true, "special tokens are always left out of the text"),
    "use_beam_search": (_false, _NO),
    "length_penalty": (_number(1), "it applies to beam search, which this server does not do"),
    "truncate_prompt_tokens": (_null, "a prompt over the context is refused, never truncated"),
    "priority": (_number(0), "requests are served first come, first served"),
}

_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_SAMPLING,
    "tools": (_empty, _TOOLS),
    "tool_choice": (_no_tool_choice, _TOOLS),
    "functions": (_empty, _TOOLS),
    "function_call": (_no_tool_choice, _TOOLS),
    "audio": (_null, "this model has no audio output"),
    "modalities": (_text_modality, "this model outputs text only"),
    "prediction": (_null, "predicted outputs are not implemented"),
    "reasoning_effort": (_null, "this model is not a reasoning model"),
    "verbosity": (_null, _NO),
    "web_search_options": (_null, "this server has no web search"),
    "echo": (_false, "echo is supported on /v1/completions only"),
    "chat_template": (_null, "the target's own chat template is always used"),
    "chat_template_kwargs": (_empty, "the target's own chat template is always used"),
    "documents": (_null, "the target's own chat template is always used"),
    "mm_processor_kwargs": (_empty, "this model takes text only"),
    "add_special_tokens": (_false, "the chat template already places the special tokens"),
}

_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_SAMPLING,
    "suffix": (_empty, "insertion (a suffix after the completion) is not implemented"),
    "best_of": (_number(1), "only one completion per request is generated"),
}

UNSUPPORTED = {"chat": _CHAT, "completion": _COMPLETION}


def unsupported_field(kind: str, data: dict[str, Any]) -> tuple[str, str] | None:
    """The first field of the body set to a value this server cannot honour: (name, why)."""
    for name, (neutral, why) in UNSUPPORTED[kind].items():
        if name in data and not neutral(data[name]):
            return name, why
    return None
