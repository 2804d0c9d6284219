"""What the OpenAI-compatible API answers a request it rejects: an HTTP status and OpenAI's
error object (its own module, so that every part of the HTTP front can raise it)."""

from __future__ import annotations

from typing import Any


class ProtocolError(ValueError):
    """A request OpenAI's API would reject; `status` is the HTTP status to answer with."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
