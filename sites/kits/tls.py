"""TLS contexts from PEM files: a server's (its certificate and key) and a client's (the CA it
trusts), for the agents' endpoints and the broker's API (docs/auth.md). A file that does not
load is a ConfigError naming it, raised where the process starts, not at the first request."""

from __future__ import annotations

import ssl
from pathlib import Path

from sites.model.errors import ConfigError, Problem

MIN_VERSION = ssl.TLSVersion.TLSv1_2


def _why(exc: OSError | ssl.SSLError) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """TLS 1.2 or later, serving `cert` (PEM, the chain after the leaf) with its `key`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = MIN_VERSION
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([Problem(f"{cert} / {key}", "", f"cannot load: {_why(exc)}")]) from None
    return context


def client_context(ca: Path | None) -> ssl.SSLContext:
    """TLS 1.2 or later, verifying the server's certificate and host name against `ca` (PEM:
    the federation's CA), or against the system's CAs when None."""
    try:
        context = ssl.create_default_context(cafile=None if ca is None else str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([Problem(str(ca), "", f"cannot load the CA: {_why(exc)}")]) from None
    context.minimum_version = MIN_VERSION
    return context
