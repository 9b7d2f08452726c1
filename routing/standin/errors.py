"""The stand-in's errors on its OpenAI paths, in vLLM's shape.

    ApiError(ValueError)      a request the stand-in refuses: status, message, param, type

vLLM answers `{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status (an
integer) and `type` its error class (`BadRequestError`, `NotFoundError`); the body here adds
`field`, equal to `param`, the name cpn's own errors give the offending field.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError", "error_body"]


class ApiError(ValueError):
    """A refused request: the HTTP status, the message, and the field (`param`) at fault."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str | None = None,  # noqa: A002 (OpenAI's name for it)
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type or _TYPES.get(status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, type=self.type)


_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    type: str | None = None,  # noqa: A002
) -> dict[str, Any]:
    """vLLM's error object (plus `field`, cpn's name for `param`)."""
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
            "field": param,
        }
    }
