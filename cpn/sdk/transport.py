"""HTTP to the broker for the SDK (aiohttp, the project's one HTTP library): a request's JSON
answer or a stream's bytes, every failure turned into the SDK's errors (cpn.sdk.errors) where
it enters.

The session is opened on first use, in the event loop that uses it, and closed by `aclose`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ValidationError

from cpn.sdk.connection import Connection
from cpn.sdk.errors import (
    ConfigError,
    CpnError,
    Invalid,
    TransportError,
    UnexpectedAnswer,
    api_error,
)

__all__ = ["Transport", "parse", "segment"]

M = TypeVar("M", bound=BaseModel)

USER_AGENT = "cpn-sdk/1"


def segment(value: str, field: str) -> str:
    """`value` as one path segment (a job id, a service's name), refused naming `field` when
    empty; quoted, so that '/' or '..' cannot reach another route."""
    if not isinstance(value, str) or not value:
        raise Invalid(0, f"{field} must be a non-empty string, got {value!r}", field)
    return quote(value, safe="")


def parse(model: type[M], body: Any) -> M:
    """`body` as `model`; an answer that is not one is an UnexpectedAnswer naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "the answer"
        raise UnexpectedAnswer(
            f"the broker's answer is not a {model.__name__}: {where}: {first['msg']}"
        ) from None


class Transport:
    def __init__(
        self,
        connection: Connection,
        *,
        timeout_s: float | None = 60.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        # a stream (logs --follow) may last as long as the run: only connecting is bounded
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._ssl = _ssl_context(connection)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return self.connection.url

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed and self._loop is not loop:
            # aiohttp's connections belong to the loop that opened them
            raise CpnError(
                "this AsyncClient was first used in another event loop: make one per loop "
                "(or use cpn.Client, which runs its own)"
            )
        if self._session is None or self._session.closed:
            self._loop = loop
            headers = {"User-Agent": USER_AGENT}
            if self.connection.token:
                headers["Authorization"] = f"Bearer {self.connection.token}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self._ssl),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        yaml: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        """The decoded JSON answer; an error answer raises its ApiError. `json` is sent as
        JSON, or `yaml` (a document's text) as application/yaml."""
        extra: dict[str, Any] = {}
        if yaml is not None:
            extra = {"data": yaml.encode(), "headers": {"Content-Type": "application/yaml"}}
        elif json is not None:
            extra = {"json": json}
        try:
            async with self._open().request(
                method, self.url + path, params=dict(params) if params else None, **extra
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = None
                    if resp.status < 400:
                        raise UnexpectedAnswer(
                            f"{method} {path}: the answer ({resp.status}) is not JSON"
                        ) from None
                if resp.status >= 400:
                    raise api_error(resp.status, data, resp.headers)
                return data
        except aiohttp.ClientError as exc:
            raise TransportError(f"broker at {self.url} is unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise TransportError(f"broker at {self.url} did not answer in time") from exc

    async def stream(
        self, path: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """A text answer's bytes as they arrive (job logs); an error answer raises its ApiError."""
        try:
            async with self._open().get(
                self.url + path,
                params=dict(params) if params else None,
                timeout=self._stream_timeout,
            ) as resp:
                if resp.status >= 400:
                    try:
                        data = await resp.json(content_type=None)
                    except ValueError:
                        data = None
                    raise api_error(resp.status, data, resp.headers)
                async for chunk in resp.content.iter_any():
                    yield chunk
        except aiohttp.ClientError as exc:
            raise TransportError(f"broker at {self.url} is unreachable: {exc}") from exc


def _ssl_context(connection: Connection) -> ssl.SSLContext | bool:
    if not (connection.ca and connection.url.startswith("https://")):
        return True  # the system's CAs
    try:
        return ssl.create_default_context(cafile=connection.ca)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"CA file {connection.ca}: {reason}") from None
