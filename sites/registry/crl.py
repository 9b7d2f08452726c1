"""The CA's revocation list published in etcd (keys.CRL): `cpn certs revoke --publish` puts it
once, and every broker and agent that checks its peers' certificates (sites.kits.PeerTrust)
loads it within a watch's latency, wherever it runs; no file to copy to each host (etcd itself
still reads its own file: docs/auth.md, "Certificates that rotate").
"""

from __future__ import annotations

from sites.kits.tls import PeerTrust
from sites.model import keys
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror

__all__ = ["RETRY_S", "crl_mirror", "follow_crl", "publish_crl"]

RETRY_S = 10.0
"""How long the follower waits after etcd refused or failed it before listing again (an agent
whose role predates the CRL's grant is refused until its site joins again)."""


async def publish_crl(registry: Registry, pem: bytes) -> None:
    """Put the CRL where every broker and agent follows it."""
    await registry.put_raw(keys.CRL, pem)


def crl_mirror(registry: Registry, trust: PeerTrust) -> PrefixMirror:
    """A mirror of keys.CRL that adds each CRL published to `trust`."""

    def changed(items: dict[str, bytes]) -> None:
        pem = items.get(keys.CRL)
        if pem is not None:
            trust.load_pem(pem)

    return PrefixMirror(registry=registry, prefix=keys.CRL, on_change=changed, retry_s=RETRY_S)


async def follow_crl(registry: Registry, trust: PeerTrust) -> None:
    """Follow the published CRL until cancelled (a supervised task's body)."""
    await crl_mirror(registry, trust).run()
