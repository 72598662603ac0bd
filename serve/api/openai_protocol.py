"""The OpenAI-compatible protocol: request models, error bodies, response and SSE shapes.

No Ray and no model here, so the wire format is unit-tested without a server. Every field
of OpenAI's request schemas is honoured here or refused with a 400 naming it
(serve/api/params.py); unknown fields are ignored (as vLLM and OpenAI do for clients that
send extra options). An explicit null means the field's default. Every rejection is an
OpenAI-style error body with a 4xx status, never a 5xx.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serve.api.params import unsupported_field
from serve.sampling.bounds import BIAS_RANGE, PENALTY_RANGE
from serve.engine.detokenize import REPLACEMENT, StopScanner


class APIError(Exception):
    """An error answered to the client: HTTP status plus an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After with 429 and 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    # vLLM's (guidellm sends it): with include_usage, the running usage on every chunk too.
    continuous_usage_stats: bool = False
    # OpenAI's padding field against length side channels: not sent, so only off.
    include_obfuscation: Literal[False] = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _drop_nulls(cls, data)


def _drop_nulls(cls: type[BaseModel], data: Any) -> Any:
    """An explicit null for a declared field means its default (as OpenAI and vLLM read it)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
    return data


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
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    # Logits processors, applied to the target's and the draft's logits alike (serve/sampling/processors.py).
    presence_penalty: float = Field(0.0, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    # vLLM's extensions.
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Informational, with no effect on the output (OpenAI's own use is abuse monitoring,
    # caching and billing): accepted, and changes nothing.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    parallel_tool_calls: bool | None = None  # no tools are ever called (tools are refused)
    # Extension: write a training record for this request (default: the server's setting).
    osd_record: bool | None = None
    # OpenAI's: false keeps this request out of the records (record_choice); true or absent
    # leaves it to osd_record and the server's setting.
    store: bool | None = None
    # Extension: false runs this request autoregressively (no draft), e.g. for a same-server
    # AR baseline; output is the same under greedy decoding either way.
    osd_speculate: bool = True
    # vLLM's: prompt prefixes are reused only between requests of the same salt (and always
    # within a tenant), so one user cannot time whether another sent a prompt.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _drop_nulls(cls, data)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (integers >= 0), got {key!r}")
            if not -BIAS_RANGE <= bias <= BIAS_RANGE:
                raise ValueError(f"values must be in [-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {bias} for {key}")
        return v

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

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        return self.include_usage() and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    def token_budget(self) -> int | None:
        return self.max_tokens

    def processors(self) -> dict[str, Any]:
        """serve.sampling.processors.ProcessorParams' fields, as plain JSON for the replica."""
        return {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
                "logit_bias": [[int(k), b] for k, b in (self.logit_bias or {}).items()]}

    def top_logprobs_n(self) -> int | None:
        """None: no log-probs; n: each token's and the n most likely at its position."""
        return None

    def logprobs_param(self) -> str:
        return "logprobs"

    def check(self) -> None:
        """Checks past the field types: APIError(400) naming the field."""


class CompletionRequest(_Request):
    # One prompt: a string or token ids. The OpenAI schema also allows a batch (a list of
    # strings or of id lists); a batch of one is taken, a longer one refused (check()).
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False  # the prompt's text before the completion
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around the prompt
    logprobs: int | None = Field(None, ge=0)  # the chosen token's and this many most likely

    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's log-probs, which this server does not "
                           "compute; ask for one or the other", param="logprobs", code="unsupported_parameter")
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one prompt
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, f"a batch of {len(p)} prompts is not supported: send one prompt per request",
                           param="prompt")
        if isinstance(p, list):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise APIError(400, "prompt: a list of token ids must be non-empty and hold integers >= 0",
                               param="prompt")
        elif not isinstance(p, str):
            raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
        self.prompt = p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, a list of content parts, or (assistant only) null: checked in flatten().
    content: Any = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's: what the template may show
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None  # an assistant's earlier refusal, its content when that is null
    audio: Any = None
    function_call: Any = None

    def flatten(self, i: int) -> dict[str, Any]:
        """This message for the chat template: content as one string (text parts joined by a
        newline, as vLLM joins them), or APIError(400) naming the part it cannot take."""
        where = f"messages.{i}"
        for field in ("audio", "function_call"):
            if getattr(self, field) is not None:
                raise APIError(400, f"{where}.{field} is not supported: this server does not do audio or tool calling",
                               param=f"{where}.{field}", code="unsupported_parameter")
        content = self.content
        if content is None:
            if self.role != "assistant":
                raise APIError(400, f"{where}.content: a {self.role} message needs content", param=f"{where}.content")
            content = self.refusal or ""
        elif isinstance(content, list):
            content = "\n".join(_part_text(part, f"{where}.content.{j}") for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content")
        out: dict[str, Any] = {"role": self.role, "content": content}
        for field in ("name", "tool_call_id", "tool_calls"):
            if getattr(self, field):
                out[field] = getattr(self, field)
        return out


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = {"text": "text", "refusal": "refusal"}.get(kind or "")
    if key is None:
        raise APIError(400, f"{where}: content parts of type {kind!r} are not supported; this model takes "
                       f"text only (parts of type 'text')", param=f"{where}.type", code="unsupported_content")
    if not isinstance(part.get(key), str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return part[key]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's: end the prompt with the assistant's header (default), or continue the last
    # (assistant) message as it stands.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprobs_param(self) -> str:
        return "top_logprobs" if self.top_logprobs else "logprobs"

    def budget_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def flat_messages(self) -> list[dict[str, Any]]:
        return [m.flatten(i) for i, m in enumerate(self.messages)]

    def check(self) -> None:
        self.flat_messages()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                               param="continue_final_message")
            if self.messages[-1].role != "assistant":
                raise APIError(400, "continue_final_message needs an assistant message last",
                               param="continue_final_message")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _drop_nulls(cls, data)

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        self.flat_messages()

    def flat_messages(self) -> list[dict[str, Any]]:
        return [m.flatten(i) for i, m in enumerate(self.messages or ())]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    def check(self) -> None:
        pass


M = TypeVar("M", bound=BaseModel)


def parse_body(kind: type[M], raw: bytes, refused: str | None = None) -> M:
    """Bytes of the HTTP body -> a validated `kind`, or APIError(400). refused: which table of
    serve/api/params.py applies ("chat", "completion")."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_unicode(data)
    unsupported = unsupported_field(refused, data) if refused else None
    if unsupported is not None:
        name, why = unsupported
        raise APIError(400, f"{name}={json.dumps(data[name])[:200]} is not supported: {why}", param=name,
                       code="unsupported_parameter")
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    req.check()  # type: ignore[attr-defined]
    return req


def parse_request(kind: type[_Request], raw: bytes, max_new_tokens: int, max_logprobs: int | None = None) -> _Request:
    """Bytes of the HTTP body -> a validated completion request, or APIError(400).
    max_logprobs: the most log-probs a position may return (serve.capture_top_k); None: no cap."""
    req = parse_body(kind, raw, "chat" if kind is ChatCompletionRequest else "completion")
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    budget = req.token_budget()
    if budget is not None and budget > max_new_tokens:
        param = req.budget_param() if isinstance(req, ChatCompletionRequest) else "max_tokens"
        raise APIError(400, f"{param} ({budget}) is over this server's limit of {max_new_tokens}", param=param)
    if budget is not None and req.min_tokens > budget:
        raise APIError(400, f"min_tokens ({req.min_tokens}) is over the token budget ({budget})", param="min_tokens")
    top = req.top_logprobs_n()
    if top is not None and max_logprobs is not None and top > max_logprobs:
        raise APIError(400, f"{req.logprobs_param()} ({top}) is over this server's limit of {max_logprobs} "
                       f"(serve.capture_top_k)", param=req.logprobs_param())
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
    """FastAPI's schema plus the JSON bodies of the POST routes (the routes read raw bytes,
    to answer bad JSON in the OpenAI error form, so FastAPI cannot see the models itself)."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
                        ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
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


RECORD_HEADER = "X-OSD-Record"
_HEADER_OFF = ("off", "false", "0")


def record_choice(osd_record: bool | None, store: bool | None, header: str | None) -> bool | None:
    """What the client asked of its training record: False when it opted out in any of its
    three ways (`osd_record: false`, `store: false`, the X-OSD-Record header set to
    off/false/0), True when it opted in (`osd_record: true` or the header `on`), None when it
    said nothing. The tenant's policy then decides (serve/engine/tenancy.py record_decision). A
    header value other than those is APIError(400) naming the header (a typo must not
    silently record)."""
    value = None if header is None else header.strip().lower()
    if value is not None and value not in _HEADER_OFF and value != "on":
        raise APIError(400, f"{RECORD_HEADER} header must be off, false, 0 (no record) or on, got {header!r}",
                       param=RECORD_HEADER, code="invalid_header")
    if osd_record is False or store is False or value in _HEADER_OFF:
        return False
    return True if osd_record or value == "on" else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def osd_extension(result: dict[str, Any]) -> dict[str, Any]:
    """Acceptance stats in an extension field beside OpenAI's usage; `drafted_by_source`: the
    steps that drafted, by who proposed (a hybrid's head or suffix draft)."""
    out = {k: result[k] for k in ("draft_version", "acceptance_rate", "mean_accepted_len", "num_drafts",
                                  "num_draft_tokens", "num_accepted_tokens", "record_id")}
    out["drafted_by_source"] = result.get("drafted_by_source") or {}
    return out


def drafted_by_source(stats: Any) -> dict[str, dict[str, int]]:
    """A request's drafting steps by who proposed (SpecStats.by_source), as the `osd` field
    carries them, in the words of the replica's by-source table (/osd/stats): source ->
    {"steps", "drafted", "accepted"}."""
    return {src: {"steps": s, "drafted": d, "accepted": a} for src, (s, d, a) in stats.by_source.items()}


# vLLM's stand-in for a log-prob of -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _token_lp(token: str, logprob: float) -> dict[str, Any]:
    # bytes of the token's text, as vLLM sends them (a token cut inside a character reads U+FFFD).
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat choice's `logprobs` from the replica's entries ({"token", "logprob", "top": [[token,
    logprob]...]} per output token)."""
    return {"content": [{**_token_lp(e["token"], e["logprob"]),
                         "top_logprobs": [_token_lp(t, v) for t, v in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` (the legacy shape); offset: characters of text before the
    first token (a stream's earlier chunks). top_logprobs holds the chosen token too, as vLLM's."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        top = {t: _lp(v) for t, v in e["top"]}
        top.setdefault(e["token"], _lp(e["logprob"]))
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(_lp(e["logprob"]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def completion_body(req_id: str, model: str, result: dict[str, Any]) -> dict[str, Any]:
    lps = result.get("logprobs")
    return {
        "id": req_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": result["text"], "finish_reason": result["finish_reason"],
                     "logprobs": completion_logprobs(lps) if lps is not None else None}],
        "usage": result["usage"],
        "osd": osd_extension(result),
    }


def chat_body(req_id: str, model: str, result: dict[str, Any]) -> dict[str, Any]:
    lps = result.get("logprobs")
    return {
        "id": req_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"], "refusal": None},
                     "logprobs": chat_logprobs(lps) if lps is not None else None,
                     "finish_reason": result["finish_reason"]}],
        "usage": result["usage"],
        "osd": osd_extension(result),
    }


def chat_chunk(req_id: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
               extra: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    body = {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}
    if extra:
        body.update(extra)
    return f"data: {json.dumps(body)}\n\n"


def completion_chunk(req_id: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     extra: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None) -> str:
    body = {"id": req_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if extra:
        body.update(extra)
    return f"data: {json.dumps(body)}\n\n"


def usage_chunk(req_id: str, model: str, created: int, usage: dict[str, Any], chat: bool) -> str:
    """The last chunk before [DONE] when stream_options.include_usage is set: no choices."""
    body = {"id": req_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"


class IncrementalText:
    """Turn a growing list of token ids into text deltas for streaming.

    Holds back a trailing U+FFFD (a multi-byte character cut between tokens) and the last
    few characters that could still become a stop string, so the client never receives
    text the final answer will not contain. Decoding and the stop search are incremental
    (serve/engine/detokenize.py), as in the engine, so both see the same text.
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
