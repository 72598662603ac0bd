"""The engine's errors, in a module with no torch import so the CLI can name them cheaply."""

from __future__ import annotations


class EngineError(ValueError):
    """The engine cannot be built from these models (vocab mismatch, bad options)."""


class RequestError(ValueError):
    """A request is invalid (too long, empty, bad ids); raised at the call, before any token.
    `code` is the OpenAI error code the API answers with (None: a plain invalid request)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code
