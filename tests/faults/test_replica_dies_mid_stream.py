"""A replica killed while it streams a response: the client gets an SSE error event and
[DONE] at once, never a stream that hangs open. Ray raises the replica's death to the
ingress's stream as an actor error; a fake stream raises the same here (no cluster)."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import ray.exceptions as rex

from serve.api.app import OpenAIIngress
from serve.api.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request

pytestmark = pytest.mark.pure


async def _dies_after(n: int):
    for i in range(n):
        yield {"text": f"t{i}", "completion_tokens": i + 1}
    raise rex.ActorDiedError()


async def _events(req) -> list[str]:
    errors: list[str] = []
    ingress = SimpleNamespace(model_id="tiny-random", metrics=SimpleNamespace(error=lambda *a: errors.append(a)))
    out = [e async for e in OpenAIIngress._sse(ingress, _dies_after(3), {"request_id": "req-1"}, req, "", 4)]
    assert errors, "the failure was not counted"
    return out


@pytest.mark.parametrize("kind,cls", [("chat", ChatCompletionRequest), ("completion", CompletionRequest)])
def test_a_replica_dying_mid_stream_ends_it_with_an_error_and_done(kind, cls):
    body = {"model": "tiny-random", "stream": True,
            **({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"})}
    req = parse_request(cls, json.dumps(body).encode(), 64)
    events = asyncio.run(asyncio.wait_for(_events(req), timeout=10))
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["code"] == "internal_error" and "req-1" in err["error"]["message"]
    assert all(any(f'"t{i}"' in e for e in events) for i in range(3))  # what came before the death arrived
