"""Client regions from configs/clients.yaml: where clients attach, which addresses they use.

    client_regions:
      - id: beijing                     # a user region of configs/regions.yaml
        attach:                         # access links to nearby sites (ingress points)
          - {site: zhangjiakou}         # rtt_ms omitted: estimated by sites.model.latency
          - {site: horinger, rtt_ms: 9}
        cidrs: [10.1.0.0/16, "2001:db8:1::/48", 127.0.3.1/32]
        allowed_regions: [jing-jin-ji, yangtze-delta]   # sovereignty; omitted: any region

`load_clients(path, user_regions=..., sites=...)` validates the file (pydantic) and raises
sites.model.errors.ConfigError whose problems name the file and the field
(``client_regions[2].attach[0].site``). The returned `Clients` maps an address to its region by
longest-prefix match (`region_of`) and gives each region's access-link RTTs (`attach_rtt_ms`).

An ingress point that is not a site (a routing gateway in the client region) is modelled by the
site it sits next to: attach the region to that site with the gateway's RTT.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from sites.model.config import config_dir, read_yaml, validate_mapping
from sites.model.errors import ConfigError, Problem
from sites.model.latency import Endpoint, LatencyModel
from sites.model.spec import Name, SiteId, SiteSpec

__all__ = [
    "Attach",
    "ClientRegion",
    "Clients",
    "default_path",
    "load_clients",
    "parse_clients",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse_network(value: Any) -> Any:
    """'10.1.0.0/16' -> IPv4Network; strict, so '10.1.0.1/16' (host bits set) is an error."""
    if isinstance(value, str):
        try:
            return ipaddress.ip_network(value.strip(), strict=True)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not an IP network: {exc}") from None
    return value


IpNetwork = Annotated[Network, BeforeValidator(_parse_network)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Attach(_Frozen):
    """An access link from a client region to a site (or the ingress next to it)."""

    site: SiteId
    rtt_ms: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="round trip client region <-> site; None: estimate from coordinates",
    )


class ClientRegion(_Frozen):
    id: Name
    attach: tuple[Attach, ...] = Field(min_length=1)
    cidrs: tuple[IpNetwork, ...] = Field(
        default=(), description="client addresses of this region (longest prefix wins)"
    )
    allowed_regions: tuple[Name, ...] | None = Field(
        default=None,
        min_length=1,
        description="site regions that may serve this client region (sovereignty); None: any",
    )

    @field_validator("attach")
    @classmethod
    def _sites_once(cls, attach: tuple[Attach, ...]) -> tuple[Attach, ...]:
        seen: set[str] = set()
        for link in attach:
            if link.site in seen:
                raise ValueError(f"site {link.site!r} attached twice")
            seen.add(link.site)
        return attach


class _ClientsFile(_Frozen):
    client_regions: tuple[ClientRegion, ...] = Field(min_length=1)


class _PrefixTable:
    """Longest-prefix match: one hash table per prefix length, longest length first.

    A lookup masks the address once per distinct prefix length (a handful), so its cost does not
    grow with the number of networks.
    """

    def __init__(self, bits: int, networks: Iterable[tuple[Network, str]]) -> None:
        by_len: dict[int, dict[int, str]] = {}
        for net, region in networks:
            by_len.setdefault(net.prefixlen, {})[int(net.network_address)] = region
        full = (1 << bits) - 1
        self._tables = [
            (full ^ ((1 << (bits - plen)) - 1), by_len[plen])
            for plen in sorted(by_len, reverse=True)
        ]

    def lookup(self, address: int) -> str | None:
        for mask, table in self._tables:
            region = table.get(address & mask)
            if region is not None:
                return region
        return None


class Clients:
    """The validated client regions, with the address lookup precomputed."""

    def __init__(self, regions: Iterable[ClientRegion], *, source: str = "<clients>") -> None:
        self.source = source
        self.regions: dict[str, ClientRegion] = {}
        for region in regions:
            if region.id in self.regions:
                raise ValueError(f"client region {region.id!r} given twice")
            self.regions[region.id] = region
        pairs = [(net, r.id) for r in self.regions.values() for net in r.cidrs]
        self._v4 = _PrefixTable(32, [(n, r) for n, r in pairs if n.version == 4])
        self._v6 = _PrefixTable(128, [(n, r) for n, r in pairs if n.version == 6])

    def __contains__(self, region: object) -> bool:
        return region in self.regions

    def loopback_sources(self) -> dict[str, str]:
        """Region -> its single loopback address (a 127.x.y.z/32 in cidrs), for the one-machine
        demo whose WAN emulation tells a client region by the address it sends from."""
        out: dict[str, str] = {}
        for region in self.regions.values():
            for net in region.cidrs:
                if net.version == 4 and net.prefixlen == 32 and net.network_address.is_loopback:
                    out[region.id] = str(net.network_address)
                    break
        return out

    def region_of(self, address: str | Address) -> str | None:
        """The client region of `address` by longest-prefix match; None if no range holds it.

        An IPv4-mapped IPv6 address (``::ffff:10.1.2.3``, as dual-stack sockets report IPv4
        peers) is looked up as IPv4. A string that is not an address belongs to no region.
        """
        if isinstance(address, str):
            try:
                address = ipaddress.ip_address(address.strip())
            except ValueError:
                return None
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is None:
                return self._v6.lookup(int(address))
            address = address.ipv4_mapped
        return self._v4.lookup(int(address))

    def allowed_regions(self, region: str) -> frozenset[str] | None:
        """Site regions allowed to serve `region`; None when unrestricted or unknown."""
        entry = self.regions.get(region)
        if entry is None or entry.allowed_regions is None:
            return None
        return frozenset(entry.allowed_regions)

    def sovereignty(self) -> dict[str, frozenset[str]]:
        """Client region -> allowed site regions, for the regions that are restricted."""
        return {
            r.id: frozenset(r.allowed_regions)
            for r in self.regions.values()
            if r.allowed_regions is not None
        }

    def attach_rtt_ms(
        self,
        region: str,
        specs: Mapping[str, SiteSpec],
        user_regions: Mapping[str, Endpoint],
        latency: LatencyModel,
    ) -> dict[str, float]:
        """Site -> access RTT ms of `region`, for its attach sites present in `specs`.

        An omitted rtt_ms is estimated by `latency` between the region's coordinates
        (`user_regions`, from configs/regions.yaml) and the site's. Raises ConfigError naming the
        field when the region has no coordinates to estimate from.
        """
        entry = self.regions[region]
        index = list(self.regions).index(region)
        out: dict[str, float] = {}
        for j, link in enumerate(entry.attach):
            spec = specs.get(link.site)
            if spec is None:
                continue  # not joined (yet): no node to attach to
            if link.rtt_ms is not None:
                out[link.site] = link.rtt_ms
                continue
            where = user_regions.get(region)
            if where is None:
                raise ConfigError([_no_coordinates(self.source, index, j, region)])
            site_end = Endpoint(spec.coordinates.lat, spec.coordinates.lon, spec.latency_zone)
            out[link.site] = latency.rtt_ms(where, site_end)
        return out

    def check_estimable(self, user_regions: Mapping[str, Endpoint]) -> None:
        """Raise ConfigError if an omitted rtt_ms has no region coordinates to estimate from."""
        problems = [
            _no_coordinates(self.source, i, j, r.id)
            for i, r in enumerate(self.regions.values())
            for j, link in enumerate(r.attach)
            if link.rtt_ms is None and r.id not in user_regions
        ]
        if problems:
            raise ConfigError(problems)


def _no_coordinates(source: str, i: int, j: int, region: str) -> Problem:
    return Problem(
        source,
        f"client_regions[{i}].attach[{j}].rtt_ms",
        f"omitted, and region {region!r} has no coordinates in regions.yaml to estimate it from",
    )


def default_path() -> Path:
    """clients.yaml in $CPN_CONFIG_DIR, else in the repository's configs/."""
    return config_dir() / "clients.yaml"


def load_clients(
    path: str | os.PathLike[str] | None = None,
    *,
    user_regions: Mapping[str, Endpoint] | None = None,
    sites: Iterable[SiteSpec] | None = None,
) -> Clients:
    """Read and validate clients.yaml; ConfigError lists every problem with file and field.

    With `user_regions` (configs/regions.yaml, as broker.model.regions.load_user_regions returns)
    every id must be a user region and every omitted rtt_ms must be estimable; with `sites` every
    attach site must exist and every allowed region must be some site's region.
    """
    file = Path(path) if path is not None else default_path()
    return parse_clients(str(file), read_yaml(file), user_regions=user_regions, sites=sites)


def parse_clients(
    source: str,
    data: Any,
    *,
    user_regions: Mapping[str, Endpoint] | None = None,
    sites: Iterable[SiteSpec] | None = None,
) -> Clients:
    """Validate already-parsed YAML `data`; `source` names it in errors."""
    parsed = validate_mapping(source, data, _ClientsFile, "with client_regions")
    specs = None if sites is None else list(sites)
    problems = _cross_checks(source, parsed.client_regions, user_regions, specs)
    if problems:
        raise ConfigError(problems)
    # With user_regions every id is a user region, so every omitted rtt_ms can be estimated.
    return Clients(parsed.client_regions, source=source)


def _cross_checks(
    source: str,
    regions: tuple[ClientRegion, ...],
    user_regions: Mapping[str, Endpoint] | None,
    specs: list[SiteSpec] | None,
) -> list[Problem]:
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    owner: dict[Network, str] = {}
    site_ids = None if specs is None else {s.id for s in specs}
    site_regions = None if specs is None else {s.region for s in specs}
    for i, region in enumerate(regions):
        at = f"client_regions[{i}]"
        if region.id in seen_ids:
            problems.append(Problem(source, f"{at}.id", f"{region.id!r} listed twice"))
        seen_ids.add(region.id)
        if user_regions is not None and region.id not in user_regions:
            known = ", ".join(user_regions)
            problems.append(
                Problem(source, f"{at}.id", f"{region.id!r} is not a user region (known: {known})")
            )
        for j, net in enumerate(region.cidrs):
            if net in owner:
                problems.append(
                    Problem(source, f"{at}.cidrs[{j}]", f"{net} is also listed for {owner[net]!r}")
                )
            owner.setdefault(net, region.id)
        if site_ids is not None:
            for j, link in enumerate(region.attach):
                if link.site not in site_ids:
                    problems.append(
                        Problem(source, f"{at}.attach[{j}].site", f"unknown site {link.site!r}")
                    )
        if site_regions is not None:
            for k, allowed in enumerate(region.allowed_regions or ()):
                if allowed not in site_regions:
                    problems.append(
                        Problem(
                            source,
                            f"{at}.allowed_regions[{k}]",
                            f"no site is in region {allowed!r}",
                        )
                    )
    return problems
