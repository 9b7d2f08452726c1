"""The SDK's exceptions: one tree, rooted at CpnError.

    CpnError
    ├── ConfigError          no broker to talk to, or a config/CA file that cannot be used
    ├── TransportError       (also ConnectionError) the broker could not be reached, or the
    │                        connection broke mid-answer
    ├── WaitTimeout          (also TimeoutError) `jobs.wait` ran out of time; `.record` is the
    │                        job as last seen
    ├── JobEnded             `jobs.wait`: the job finished in a state that was not asked for
    │                        (it can never reach one that was); `.record`
    ├── UnexpectedAnswer     a success answer that is not JSON, or not the record the SDK
    │                        expects (a broker of another version, a proxy's page)
    └── ApiError             the broker answered 4xx/5xx `{"error": {"code", "message", "field"}}`:
        │                    `.status`, `.code`, `.message`, `.field`, `.request_id`
        ├── Invalid          400, 413, 415, 422: the request is wrong; `.field` names what
        ├── Unauthorized     401: no token, or one unknown, expired or revoked
        ├── Forbidden        403: the token's role or tenant may not do this (`.field`)
        ├── NotFound         404: no such job, service, workflow (or another tenant's)
        ├── Conflict         409: an illegal transition, a duplicate, a lost race, no logs yet
        ├── Gone             410: a list's `continue` token expired; list again
        ├── RateLimited      429: `.retry_after_s`, from Retry-After
        └── ServerError      5xx: the registry or a site is unavailable (503), a site failed
                             (502, 504), or a bug (500)

`str(error)` of an ApiError is its message with `(field: x)` after it, as the CLI prints it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ApiError",
    "ConfigError",
    "Conflict",
    "CpnError",
    "Forbidden",
    "Gone",
    "Invalid",
    "JobEnded",
    "NotFound",
    "RateLimited",
    "ServerError",
    "TransportError",
    "Unauthorized",
    "UnexpectedAnswer",
    "WaitTimeout",
    "api_error",
]


class CpnError(Exception):
    """Every error the SDK raises."""


class ConfigError(CpnError):
    """No broker URL could be found, or the config file or a CA file cannot be used."""


class TransportError(CpnError, ConnectionError):
    """The broker could not be reached, or the connection broke before the answer was read."""


class WaitTimeout(CpnError, TimeoutError):
    """`jobs.wait` gave up; `record` is the job as it was last seen (None: never read)."""

    def __init__(self, message: str, record: Any = None) -> None:
        super().__init__(message)
        self.record = record


class JobEnded(CpnError):
    """`jobs.wait`: the job reached a final state other than those waited for."""

    def __init__(self, message: str, record: Any) -> None:
        super().__init__(message)
        self.record = record


class UnexpectedAnswer(CpnError):
    """A success answer the SDK cannot read: not JSON, or not the record it expects."""


class ApiError(CpnError):
    """An error answer of the broker's API."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        *,
        code: str = "error",
        request_id: str | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.request_id = request_id
        super().__init__(message + (f" (field: {field})" if field else ""))


class Invalid(ApiError):
    """400, 413, 415 or 422: the request is malformed or a value is wrong (`field` names it)."""


class Unauthorized(ApiError):
    """401: no token, or a token that is malformed, unknown, expired or revoked."""


class Forbidden(ApiError):
    """403: the token may not do this (its role, or another tenant's resource by name)."""


class NotFound(ApiError):
    """404: no such resource (another tenant's is not found either)."""


class Conflict(ApiError):
    """409: an illegal transition (cancel a finished job), a duplicate, a lost race, or logs
    of a job that has not run yet (`code` says which)."""


class Gone(ApiError):
    """410: the `continue` token of a list has expired; list again from the first page."""


class RateLimited(ApiError):
    """429: too many requests; `retry_after_s` is the broker's Retry-After (None: not given)."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        *,
        code: str = "error",
        request_id: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(status, message, field, code=code, request_id=request_id)
        self.retry_after_s = retry_after_s


class ServerError(ApiError):
    """5xx: the broker, its registry or a site behind it failed or is unavailable."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: Invalid,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    413: Invalid,
    415: Invalid,
    422: Invalid,
}


def api_error(status: int, body: Any, headers: Mapping[str, str] | None = None) -> ApiError:
    """The exception for an error answer: `body` is its decoded JSON (or anything else, when
    it was not the API's error shape), `headers` its headers (Request-Id, Retry-After)."""
    headers = headers or {}
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {}
    message = err.get("message")
    if not isinstance(message, str) or not message:
        message = f"HTTP {status}"
    field, code = err.get("field"), err.get("code")
    field = field if isinstance(field, str) else None
    code = code if isinstance(code, str) else "error"
    request_id = headers.get("X-Request-Id")
    if status == 429:
        return RateLimited(
            status,
            message,
            field,
            code=code,
            request_id=request_id,
            retry_after_s=_seconds(headers.get("Retry-After")),
        )
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(status, message, field, code=code, request_id=request_id)


def _seconds(value: str | None) -> float | None:
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from the broker; the caller picks its own backoff
