"""Typed errors every layer may raise and the server maps to HTTP answers.

`InvalidArgumentError` is a `ValueError` (callers that catch ValueError keep working) that
names the offending argument in `.param`, exactly as a client spelled it (a SamplingParams
field, `prompt`, `messages`, ...), or None when no single argument is to blame. The server
puts `.param` into OpenAI's error body; nothing parses the message text.
"""

from __future__ import annotations


class InvalidArgumentError(ValueError):
    """A bad argument, found before any work started; `param` names it (or None)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
