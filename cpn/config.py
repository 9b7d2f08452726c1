"""The CLI's config file: which broker to talk to and with which token (kubeconfig-like).

    $CPN_CONFIG, else $XDG_CONFIG_HOME/cpn/config.yaml, else ~/.config/cpn/config.yaml

    current: up
    brokers:
      up: {url: http://127.0.0.1:8080, token: cpn_...}
      prod: {url: https://broker.example:8443, token: cpn_..., ca: /etc/cpn/ca.pem}

The file is written with mode 0600 (it holds tokens) and read only if no other user may read
it. `cpn up` adds the entry `up` with its admin token and makes it current. What a command
uses: the broker URL from `--broker`, else $CPN_BROKER, else the current entry, else the
running `cpn up`; the token from $CPN_TOKEN, else the entry whose URL is that broker's; for an
https:// broker, the CA to trust from $CPN_CA, else that entry's `ca`, else the system's.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cpn.state import write_private

__all__ = ["Context", "config_path", "load_contexts", "save_context"]


@dataclass(frozen=True)
class Context:
    name: str
    url: str
    token: str | None
    ca: str | None = None  # a CA file for an https:// broker whose certificate it signed


class ConfigFileError(Exception):
    """The config file exists but cannot be used (unreadable, not YAML, readable by others)."""


def config_path() -> Path:
    env = os.environ.get("CPN_CONFIG")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "cpn" / "config.yaml"


def _read(path: Path) -> dict[str, Any]:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return {}
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigFileError(f"{path}: readable by others (mode {oct(mode & 0o777)}); chmod 600")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{path}: expected a mapping with current and brokers")
    return doc


def load_contexts() -> tuple[str | None, dict[str, Context]]:
    """(current entry's name, every entry) of the config file; nothing if it is absent."""
    path = config_path()
    doc = _read(path)
    brokers = doc.get("brokers") or {}
    if not isinstance(brokers, dict):
        raise ConfigFileError(f"{path}: brokers: expected a mapping of name -> {{url, token}}")
    out = {}
    for name, entry in brokers.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigFileError(f"{path}: brokers.{name}: expected {{url, token}}")
        token, ca = entry.get("token"), entry.get("ca")
        out[str(name)] = Context(
            str(name),
            entry["url"].rstrip("/"),
            str(token) if token else None,
            str(ca) if ca else None,
        )
    current = doc.get("current")
    return (str(current) if current else None), out


def save_context(
    name: str, url: str, token: str | None, *, current: bool = True, ca: str | None = None
) -> Path:
    """Add or replace entry `name`; written atomically with mode 0600."""
    path = config_path()
    doc = _read(path)
    brokers = doc.setdefault("brokers", {})
    brokers[name] = {
        "url": url,
        **({"token": token} if token else {}),
        **({"ca": ca} if ca else {}),
    }
    if current:
        doc["current"] = name
    write_private(path, yaml.safe_dump(doc, sort_keys=False))
    return path


def remove_context(name: str, *, url: str | None = None) -> None:
    """Drop entry `name` (if given, only while it still points at `url`): `cpn up`, when it
    stops, removes its own."""
    path = config_path()
    try:
        doc = _read(path)
    except ConfigFileError:
        return
    brokers = doc.get("brokers") or {}
    entry = brokers.get(name)
    if not isinstance(entry, dict) or (url is not None and entry.get("url") != url):
        return
    del brokers[name]
    if doc.get("current") == name:
        doc["current"] = None
    write_private(path, yaml.safe_dump(doc, sort_keys=False))
