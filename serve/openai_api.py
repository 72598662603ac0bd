"""The OpenAI-compatible protocol: request models, error bodies, response and SSE shapes.

No Ray and no model here, so the wire format is unit-tested without a server. Unknown
request fields are ignored (as vLLM and OpenAI do for clients that send extra options);
known fields are type-checked, and every rejection is an OpenAI-style error body with a
4xx status, never a 5xx.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.detokenize import REPLACEMENT, StopScanner


class APIError(Exception):
    """An error answered to the client: HTTP status plus an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After with 429 and 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # vLLM's extension; 0 or -1 disables it.
    top_k: int = Field(0, ge=-1)
    # torch.Generator.manual_seed's range; outside it the seed could not be used (400, not 500).
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1)
    # Extension: write a training record for this request (default: the server's setting).
    osd_record: bool | None = None
    # Extension: false runs this request autoregressively (no draft), e.g. for a same-server
    # AR baseline; output is the same under greedy decoding either way.
    osd_speculate: bool = True

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(_Request):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_request(kind: type[_Request], raw: bytes, max_new_tokens: int) -> _Request:
    """Bytes of the HTTP body -> a validated request, or APIError(400)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_unicode(data)
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    budget = req.token_budget() if isinstance(req, ChatCompletionRequest) else req.max_tokens
    if budget is not None and budget > max_new_tokens:
        raise APIError(400, f"max_tokens ({budget}) is over this server's limit of {max_new_tokens}",
                       param="max_tokens")
    return req


def _check_unicode(data: Any) -> None:
    """JSON may escape lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode: refuse
    them here rather than fail in the replica."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"request body has a string that is not valid Unicode ({e.reason})") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None


_ERROR_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
                   "413": "body over the size limit", "415": "not application/json",
                   "429": "queue full (Retry-After)", "503": "no slot in time, or overloaded (Retry-After)"}


def openapi_with_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's schema plus the JSON bodies of the two POST routes (the routes read raw bytes,
    to answer bad JSON in the OpenAI error form, so FastAPI cannot see the models itself)."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest)):
        op = schema.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(body.pop("$defs", {}))
        comps[model.__name__] = body
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        op.setdefault("responses", {}).update(
            {code: {"description": what} for code, what in _ERROR_STATUSES.items()})
    return schema


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def osd_extension(result: dict[str, Any]) -> dict[str, Any]:
    """Acceptance stats in an extension field beside OpenAI's usage."""
    return {k: result[k] for k in ("draft_version", "acceptance_rate", "mean_accepted_len", "num_drafts",
                                   "num_draft_tokens", "num_accepted_tokens", "record_id")}


def completion_body(req_id: str, model: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": req_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}],
        "usage": result["usage"],
        "osd": osd_extension(result),
    }


def chat_body(req_id: str, model: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": req_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                     "finish_reason": result["finish_reason"]}],
        "usage": result["usage"],
        "osd": osd_extension(result),
    }


def chat_chunk(req_id: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
               extra: dict[str, Any] | None = None) -> str:
    body = {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    if extra:
        body.update(extra)
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"


class IncrementalText:
    """Turn a growing list of token ids into text deltas for streaming.

    Holds back a trailing U+FFFD (a multi-byte character cut between tokens) and the last
    few characters that could still become a stop string, so the client never receives
    text the final answer will not contain. Decoding and the stop search are incremental
    (serve/detokenize.py), as in the engine, so both see the same text.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = ()):
        self.scan = StopScanner(tokenizer, stops)
        self.sent = 0
        self.hold = max((len(s) for s in self.scan.stops), default=1) - 1

    def push(self, new_ids: list[int]) -> str:
        self.scan.push(new_ids)
        decoder = self.scan.decoder
        end = len(decoder)
        safe = end - self.hold
        if self.scan.stop_at is not None:  # a completed stop string: nothing from its start on is sent
            safe = min(safe, self.scan.stop_at)
        if end and decoder.text_from(end - 1) == REPLACEMENT:
            safe = min(safe, end - 1)
        if safe <= self.sent:
            return ""
        delta = decoder.text_from(self.sent)[: safe - self.sent]
        self.sent = safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (which is already cut at any stop string)."""
        delta = final_text[self.sent:]
        self.sent = len(final_text)
        return delta
