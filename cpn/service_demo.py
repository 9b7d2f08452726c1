"""The demo's managed inference service (`cpn up`; configs/services/example.yaml, or
--service FILE; --no-service: none): its name read before anything starts, then, once the
broker answers, the file applied through the broker's API as `cpn service apply` would
(PUT /v1/services/<name>) and its ready replicas reported as they change.

A file that is not a mapping with a name is a ConfigError (`cpn up` exits 2); a file the
broker refuses is reported, not fatal: the rest of the demo runs on.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import yaml

from sites.model.config import read_yaml
from sites.model.errors import ConfigError, Problem

__all__ = ["follow", "service_name", "service_text"]


def service_name(path: Path) -> str:
    """The service's name (a file that is not a mapping with a name is a ConfigError)."""
    doc = read_yaml(path)  # ConfigFileError: exit 2 with one line
    name = doc.get("name") if isinstance(doc, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError([Problem(str(path), "name", "a service file needs a name")])
    return name


def service_text(path: Path, regions: Sequence[str] | None) -> str:
    """The file as sent. With `regions` (`cpn up --sites`: the regions of the sites that run),
    a service that names no `regions` of its own may run in those: the broker refuses a replica
    whose allowed regions (a client region's sovereignty list) name a region no running site
    is in."""
    text = path.read_text()
    doc = read_yaml(path)
    if regions is None or not isinstance(doc, dict) or "regions" in doc:
        return text
    doc["regions"] = list(regions)
    return str(yaml.safe_dump(doc, sort_keys=False))


async def follow(
    broker_url: str,
    token: str | None,
    ca: Path | None,
    name: str,
    path: Path,
    regions: Sequence[str] | None,
) -> None:
    """Apply the service once the broker takes it (retried while the broker starts), then
    report its ready replicas as they change, until cancelled (a supervised task of `cpn up`)."""
    text = service_text(path, regions)
    context: ssl.SSLContext | bool = True
    if ca is not None:
        context = ssl.create_default_context(cafile=str(ca))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{broker_url}/v1/services/{name}"
    async with aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(ssl=context),
        timeout=aiohttp.ClientTimeout(total=10),
    ) as http:
        if not await _apply(http, url, path, text):
            await asyncio.Event().wait()  # nothing to follow; cancelled with the demo
        shown: tuple[int, int] | None = None
        while True:
            await asyncio.sleep(2.0)
            try:
                async with http.get(url) as resp:
                    view = await resp.json() if resp.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue  # the broker restarting: the supervisor reports that
            if view is None:
                continue
            counts = (
                sum(r["ready"] for r in view["regions"]),
                sum(r["desired"] for r in view["regions"]),
            )
            if counts != shown:
                shown = counts
                print(
                    f"cpn up: service {name}: {counts[0]}/{counts[1]} replicas ready",
                    flush=True,
                )


async def _apply(http: aiohttp.ClientSession, url: str, path: Path, text: str) -> bool:
    """PUT the service file until the broker takes it (True) or refuses it (False)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            async with http.put(
                url, data=text.encode(), headers={"Content-Type": "application/yaml"}
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status in (200, 201):
                    print(
                        f"cpn up: service {body['name']} applied from {path}; its replicas "
                        "follow (cpn services)",
                        flush=True,
                    )
                    return True
                if 400 <= resp.status < 500:
                    err = body.get("error", {}) if isinstance(body, dict) else {}
                    print(
                        f"cpn up: the broker refused service file {path}: "
                        f"{err.get('message', resp.status)} (field {err.get('field')})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return False
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            print(
                f"cpn up: service file {path} not applied: the broker did not take it within 120 s",
                file=sys.stderr,
                flush=True,
            )
            return False
        await asyncio.sleep(0.5)
