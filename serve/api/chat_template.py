"""A conversation -> prompt token ids, through the target's own chat template, as HF applies it.

The messages arrive flattened by serve/api/openai_protocol.py (content is one string). Two OpenAI
roles are older than most templates: `developer` is OpenAI's new name for `system`, so it is
rendered as `system` unless the template knows it; and an assistant's `tool_calls`, which a
template that never reads them would drop, are refused rather than lost.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from serve.engine.errors import RequestError


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
    template = tokenizer.chat_template or ""
    if not template:
        raise RequestError("this model carries no chat template (none in its GGUF metadata or its directory's "
                           "tokenizer config): send a plain prompt to /v1/completions instead")
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls") and "tool_calls" not in template:
            raise RequestError(f"messages.{i}.tool_calls: this model's chat template cannot show tool calls")
        if m["role"] == "developer" and "developer" not in template:
            m = {**m, "role": "system"}
        out.append(m)
    try:
        ids = tokenizer.apply_chat_template(out, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tokenize=True)
    except (TemplateError, ValueError) as e:  # the template's own refusal, e.g. "roles must alternate"
        raise RequestError(f"the chat template refused these messages: {e}") from None
    # transformers 5 returns a BatchEncoding here; older versions a plain list.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
