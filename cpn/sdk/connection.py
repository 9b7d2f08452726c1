"""Which broker the SDK talks to, with which token and CA: what the `cpn` CLI uses
(cpn.config describes the file).

    URL:   the argument, else $CPN_BROKER, else the config file's current entry, else the
           running `cpn up`'s broker
    token: the argument, else $CPN_TOKEN, else the config entry whose URL is that broker's,
           else the running `cpn up`'s admin token when it is that broker
    CA:    (https:// only) the argument, else $CPN_CA, else that entry's `ca`, else the
           running `cpn up --secure`'s, else the system's
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cpn.config import ConfigFileError, load_contexts
from cpn.sdk.errors import ConfigError
from cpn.state import read_up_state

__all__ = ["Connection", "NoBroker", "resolve"]


class NoBroker(ConfigError):
    """No URL was given and none is configured (no $CPN_BROKER, config entry or `cpn up`)."""


@dataclass(frozen=True)
class Connection:
    url: str  # without a trailing '/'
    token: str | None = None
    ca: str | None = None  # a CA file to trust for an https:// broker

    def __repr__(self) -> str:  # never the token
        return (
            f"Connection(url={self.url!r}, token={'***' if self.token else None}, ca={self.ca!r})"
        )


def resolve(url: str | None = None, token: str | None = None, ca: str | None = None) -> Connection:
    """The broker, token and CA to use, each given or found as the CLI finds it."""
    try:
        current, contexts = load_contexts()
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    state = read_up_state()
    found = url or os.environ.get("CPN_BROKER")
    if not found and current in contexts:
        found = contexts[current].url
    if not found and state:
        found = state.get("broker")
    if not found:
        raise NoBroker("no broker: pass --broker URL, set CPN_BROKER, or start `cpn up`")
    found = str(found).rstrip("/")
    if not found.startswith(("http://", "https://")):
        raise ConfigError(f"broker URL {found!r}: expected http:// or https://")
    up_is_it = state is not None and str(state.get("broker", "")).rstrip("/") == found
    if token is None:
        token = os.environ.get("CPN_TOKEN") or None
    if token is None:
        token = next((c.token for c in contexts.values() if c.url == found and c.token), None)
    if token is None and up_is_it and state:
        token = state.get("token")
    if ca is None and found.startswith("https://"):
        ca = os.environ.get("CPN_CA") or None
        if ca is None:
            ca = next((c.ca for c in contexts.values() if c.url == found and c.ca), None)
        if ca is None and up_is_it and state:
            ca = state.get("ca")
    return Connection(found, token, ca)
