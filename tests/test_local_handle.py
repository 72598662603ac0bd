"""serve/api/local_handle.py: the ingress's calls reach a replica in its own process as they
would through a Serve handle (awaitables, a streaming generator, no private methods)."""
import asyncio

import pytest

from serve.api.local_handle import LocalHandle

pytestmark = pytest.mark.pure


class Replica:
    def __init__(self):
        self.calls = []

    def stats(self, recent=False):
        self.calls.append(("stats", recent))
        return {"recent": recent}

    async def generate(self, req):
        await asyncio.sleep(0)
        return {"text": req["prompt"].upper()}

    async def generate_stream(self, req):
        for word in req["prompt"].split():
            await asyncio.sleep(0)
            yield {"text": word}
        yield {"done": True}

    def _secret(self):
        return "no"


def test_plain_and_async_methods_answer_through_awaitables():
    h = LocalHandle(Replica())

    async def go():
        calls = [h.stats.remote(), h.stats.remote(True)]
        assert not h._target.calls  # a call runs when awaited, as a handle's reply is awaited
        return await asyncio.gather(*calls), await h.generate.remote({"prompt": "hi"})

    (plain, recent), gen = asyncio.run(go())
    assert plain == {"recent": False} and recent == {"recent": True} and gen == {"text": "HI"}


def test_a_stream_yields_the_replicas_items_in_order():
    h = LocalHandle(Replica())

    async def go():
        gen = h.options(stream=True).generate_stream.remote({"prompt": "a b c"})
        first = await gen.__anext__()  # the ingress reads the first item before answering
        return [first] + [item async for item in gen]

    assert asyncio.run(go()) == [{"text": "a"}, {"text": "b"}, {"text": "c"}, {"done": True}]


def test_private_and_missing_methods_are_refused():
    h = LocalHandle(Replica())
    with pytest.raises(AttributeError):
        h._secret.remote()
    with pytest.raises(AttributeError):
        h.nothing.remote()


def test_a_client_that_hangs_up_ends_the_replicas_stream_at_once():
    """The ingress's SSE closes an in-process replica's stream when the client leaves, so the
    request's slot comes back then, not when the generator is garbage-collected."""
    import json
    from types import SimpleNamespace

    from serve.api.app import OpenAIIngress
    from serve.api.openai_protocol import ChatCompletionRequest, parse_request

    ended = []

    async def replica_stream():
        try:
            for i in range(1000):
                await asyncio.sleep(0)
                yield {"text": f"t{i}", "completion_tokens": i + 1}
        finally:
            ended.append(True)  # generate_stream's finally: the engine's request is cancelled here

    req = parse_request(ChatCompletionRequest, json.dumps(
        {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode(), 64)
    ingress = SimpleNamespace(model_id="m", metrics=SimpleNamespace(error=lambda *a: None))

    async def client_leaves_after_two_chunks():
        sse = OpenAIIngress._sse(ingress, replica_stream(), {"request_id": "req-1"}, req, "", 4)
        chunks = [await sse.__anext__(), await sse.__anext__()]
        await sse.aclose()  # what Starlette does when the client disconnects
        return chunks, list(ended)  # before asyncio.run's shutdown closes leftover generators

    chunks, ended_at_hang_up = asyncio.run(client_leaves_after_two_chunks())
    assert '"t0"' in chunks[1] and ended_at_hang_up == [True]
