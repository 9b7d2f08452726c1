"""The backups' copies at the sites, from the command line (cpn.backup_cli): what the leader
broker does after each backup (broker.ops.backup_copies), here for `cpn backup create`, and
reading them back (`cpn backup ls --from`, `cpn backup fetch`).

A site is reached one of two ways:

- by its id, through the registry: its agent's URL, and a grant signed with its data key
  (what the brokers read; etcd's root does too): `--from SITE`, or every site when none is
  named;
- by its agent's URL, with an admin token ($CPN_TOKEN): what is left when the broker's host,
  and etcd with it, is gone (docs/backup.md, "When the broker's host is lost").
"""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from pydantic import ValidationError

from broker.ops.backup_copies import Remote, Shelf, shelves
from broker.state.auth import Role, TokenRecord
from cpn.cli_base import UsageError
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.snapshot import Snapshot
from sites.model.status import AgentSecret
from sites.registry.client import Registry

__all__ = ["agent_session", "is_url", "readers_of", "remote_by_url", "shelves_of"]

TIMEOUT_S = 60.0  # a listing, a removal (a copy or a fetch: backup_copies.TRANSFER_TIMEOUT)


def is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


@asynccontextmanager
async def agent_session(ca: str | None) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the agents: https:// ones verified with `ca` (the federation's CA)."""
    context: ssl.SSLContext | bool = True
    if ca:
        if not Path(ca).is_file():
            raise UsageError(f"--agent-ca: no such file {ca}")
        context = ssl.create_default_context(cafile=ca)
    connector = aiohttp.TCPConnector(ssl=context)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        yield http


async def shelves_of(registry: Registry) -> list[Shelf]:
    """The sites that may keep (or hold) a copy now, read from the registry."""
    sites = Snapshot(revision=0)
    for prefix in (keys.SITES, keys.AGENTS):
        _, kvs = await registry.list_prefix(prefix)
        for key, value, _ in kvs:
            sites.apply(key, value)
    _, secrets = await registry.list_prefix(keys.AGENT_SECRETS)
    data_keys = {}
    for key, value, _ in secrets:
        try:
            found = AgentSecret.model_validate_json(value).data_key
        except ValidationError:
            continue
        if found is not None:
            data_keys[key[len(keys.AGENT_SECRETS) :]] = found
    return shelves(sites, data_keys)


async def readers_of(registry: Registry) -> list[dict[str, object]]:
    """The admin tokens (id, sha256, expires_at) that may read a site's backups."""
    _, kvs = await registry.list_prefix(keys.TOKENS)
    now = SystemClock().time()
    out: list[dict[str, object]] = []
    for _, value, _ in kvs:
        try:
            t = TokenRecord.model_validate_json(value)
        except ValidationError:
            continue
        if t.role is Role.admin and (t.expires_at is None or t.expires_at > now):
            out.append({"id": t.id, "sha256": t.sha256, "expires_at": t.expires_at})
    return out


def remote_by_url(url: str) -> Remote:
    """An agent by its URL, with the admin token in $CPN_TOKEN."""
    token = os.environ.get("CPN_TOKEN")
    if not token:
        raise UsageError(
            f"--from {url}: reading an agent's backups by its URL needs an admin token in "
            "$CPN_TOKEN"
        )
    return Remote(url, url.rstrip("/"), {"Authorization": f"Bearer {token}"})
