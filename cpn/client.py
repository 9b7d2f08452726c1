"""A small client of the broker's API for the CLI commands not yet on the Python SDK (cpn.sdk:
tokens, audit, tenants, datasets' files, load, `cpn up`'s wait); it finds the broker, token and
CA as the SDK does (cpn.sdk.connection)."""

from __future__ import annotations

import ssl
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from cpn.config import ConfigFileError
from cpn.sdk.connection import NoBroker, resolve


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        self.status = status
        self.field = field
        super().__init__(message + (f" (field: {field})" if field else ""))


def broker_url(explicit: str | None) -> str:
    return connection(explicit)[0]


def connection(explicit: str | None) -> tuple[str, str | None]:
    """(broker URL, token) as cpn.config describes, found as the SDK finds them
    (cpn.sdk.connection): --broker, $CPN_BROKER, the config file's current entry, the running
    `cpn up`; $CPN_TOKEN, else the token stored for that URL."""
    try:
        found = resolve(explicit)
    except NoBroker as exc:
        raise ApiError(0, str(exc)) from None
    return found.url, found.token


def certificate_authority(url: str) -> str | None:
    """The CA file to trust for an https:// broker: $CPN_CA, else the config entry of that
    URL's `ca`, else the running `cpn up --secure`'s; None: the system's CAs."""
    return resolve(url).ca


class BrokerClient:
    def __init__(self, url: str, token: str | None = None, *, ca: str | None = None) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {token}"} if token else None
        context: ssl.SSLContext | bool = True
        if ca and url.startswith("https://"):
            try:
                context = ssl.create_default_context(cafile=ca)
            except (OSError, ssl.SSLError) as exc:
                reason = getattr(exc, "strerror", None) or exc
                raise ConfigFileError(f"CA file {ca}: {reason}") from None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=context),
        )

    @classmethod
    def to(cls, explicit: str | None) -> BrokerClient:
        """A client of the broker (with the token and CA) cpn.config resolves."""
        url, token = connection(explicit)
        return cls(url, token, ca=certificate_authority(url))

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session (token, TLS) for what a command streams itself (cpn.data_cli's files)."""
        return self._session

    async def __aenter__(self) -> BrokerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def call(
        self, method: str, path: str, body: Any = None, *, yaml: str | None = None, **params: str
    ) -> Any:
        """`body` is sent as JSON, or `yaml` (a document's text) as application/yaml."""
        extra: dict[str, Any] = {"json": body}
        if yaml is not None:
            extra = {"data": yaml.encode(), "headers": {"Content-Type": "application/yaml"}}
        try:
            async with self._session.request(
                method, self.url + path, params=params or None, **extra
            ) as resp:
                data = await resp.json(content_type=None)
                if resp.status >= 400:
                    err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
                    raise ApiError(
                        resp.status, err.get("message", f"HTTP {resp.status}"), err.get("field")
                    )
                return data
        except aiohttp.ClientError as exc:
            raise ApiError(0, f"broker at {self.url} is unreachable: {exc}") from exc

    async def pages(
        self, path: str, params: dict[str, str], *, limit: int | None, page: int = 500
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The items of a paged list (GET /v1/jobs, /v1/audit), a page at a time, following
        `continue` until the last page or `limit` items in all (None: every one)."""
        shown, token = 0, None
        while limit is None or shown < limit:
            asked = {**params, "limit": str(page if limit is None else min(page, limit - shown))}
            if token:
                asked["continue"] = token
            answer = await self.call("GET", path, **asked)
            yield answer["items"]
            shown += len(answer["items"])
            token = answer.get("continue")
            if not token:
                return

    async def stream(self, path: str, **params: str) -> None:
        """Copy a text stream (job logs) to stdout as it arrives."""
        try:
            async with self._session.get(self.url + path, params=params or None) as resp:
                if resp.status >= 400:
                    data = await resp.json(content_type=None)
                    err = data.get("error", {}) if isinstance(data, dict) else {}
                    raise ApiError(resp.status, err.get("message", f"HTTP {resp.status}"))
                async for chunk in resp.content.iter_any():
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
        except aiohttp.ClientError as exc:
            raise ApiError(0, f"broker at {self.url} is unreachable: {exc}") from exc
