"""The one exception the translations raise: a client's body that cannot be translated (a 400)."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Malformed or unsupported input; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
