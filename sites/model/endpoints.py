"""etcd endpoint URLs: parsing them, and the target string gRPC fails over with."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


def uses_tls(urls: str) -> bool:
    """True for https:// endpoints, False for http:// (or none given); ValueError if mixed."""
    schemes = {
        u.strip().split("://", 1)[0] if "://" in u else "http" for u in urls.split(",") if u.strip()
    }
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints {urls!r}: mixed http:// and https://")
    return schemes == {"https"}


def parse_endpoints(urls: str) -> list[tuple[str, int]]:
    """'http://127.0.0.1:2379,http://10.0.0.2:2379' -> [(host, port), ...]; ValueError if bad.

    https:// endpoints are etcd with TLS (`uses_tls`); the scheme is the same for all."""
    uses_tls(urls)
    endpoints: list[tuple[str, int]] = []
    for raw in urls.split(","):
        url = raw.strip()
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {raw!r}: expected http:// or https://")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"etcd endpoint {raw!r}: bad port") from None
        if not parts.hostname or port is None:
            raise ValueError(f"etcd endpoint {raw!r}: expected {parts.scheme}://HOST:PORT")
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
