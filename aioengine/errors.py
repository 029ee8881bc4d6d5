"""Typed exceptions callers can catch (the server maps them to HTTP statuses)."""
from __future__ import annotations


class ConfigError(ValueError):
    """An engine setting is invalid (raised at start-up; aioengine.config re-exports it)."""


class InvalidRequestError(ValueError):
    """The caller's request is invalid (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or died); no request can be served."""


class NotFoundError(LookupError):
    """What the request names does not exist (HTTP 404): a model or adapter name."""
