"""The part of a Serve deployment handle that the ingress uses, over a replica in its own process.

With `serve.ingress` "replica" (serve/api/app.py build_app) the OpenAI routes run inside the
lone target replica: the ingress then calls the replica's methods directly instead of through
a handle, so a streamed token takes one Ray hop (replica to HTTP proxy) instead of two, and the
machine runs one process fewer beside the forward.

Only what `OpenAIIngress` calls is offered: `options(stream=...)` and `.method.remote(...)`,
which returns an awaitable (or, for an async generator method, the generator itself, whose
`__anext__` and `async for` are what a streaming handle's response offers).
"""
from __future__ import annotations

import inspect
from typing import Any


class LocalHandle:
    def __init__(self, target: Any):
        self._target = target

    def options(self, **_: Any) -> "LocalHandle":
        return self  # stream=True: an async generator method already streams

    def __getattr__(self, name: str) -> "LocalMethod":
        if name.startswith("_"):  # private methods are not callable through a handle either
            raise AttributeError(name)
        return LocalMethod(getattr(self._target, name))


class LocalMethod:
    def __init__(self, fn: Any):
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if inspect.isasyncgenfunction(self._fn):
            return self._fn(*args, **kwargs)
        return self._call(*args, **kwargs)

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        out = self._fn(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out
