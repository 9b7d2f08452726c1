"""etcd endpoint URLs: parsing them, and the target string gRPC fails over with."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


def parse_endpoints(urls: str) -> list[tuple[str, int]]:
    """'http://127.0.0.1:2379,http://10.0.0.2:2379' -> [(host, port), ...]; ValueError if bad."""
    endpoints: list[tuple[str, int]] = []
    for raw in urls.split(","):
        url = raw.strip()
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"etcd endpoint {raw!r}: only http:// is supported")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"etcd endpoint {raw!r}: bad port") from None
        if not parts.hostname or port is None:
            raise ValueError(f"etcd endpoint {raw!r}: expected http://HOST:PORT")
        endpoints.append((parts.hostname, port))
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    return endpoints


def grpc_target(endpoints: Sequence[tuple[str, int]]) -> tuple[str, int]:
    """The (host, port) pair aetcd formats into a gRPC target.

    With several IP endpoints we hand gRPC an `ipv4:a:1,b:2` address list, so it fails over
    between members by itself; aetcd appends `:port` to host, hence the split.
    """
    if len(endpoints) == 1:
        return endpoints[0]
    try:
        for host, _ in endpoints:
            ipaddress.IPv4Address(host)
    except ValueError:
        log.warning("several etcd endpoints given by name; using %s:%d", *endpoints[0])
        return endpoints[0]
    head = ",".join(f"{h}:{p}" for h, p in endpoints[:-1])
    return f"ipv4:{head},{endpoints[-1][0]}", endpoints[-1][1]
