"""Upstream health for the inference proxy: passive outlier ejection and active health checks.

Two pure state machines, each fed observations with the time they were made (no clock reads),
and one thin I/O shell:

OutlierDetector (passive, Envoy's outlier detection)
    Every proxied attempt reports ok or failed (5xx, timeout, connect error) for its upstream
    key. `consecutive_failures` failures in a row eject the key for
    min(base_ejection_time_s * times_ejected, max_ejection_time_s), so an upstream that keeps
    failing is ejected for longer each time. When the ejection ends the key is tried again
    with a clean failure count; reports that arrive while it is ejected (requests that were
    already in flight) are ignored. Like Envoy, the multiplier decays: each
    base_ejection_time_s spent not ejected takes one off times_ejected.

HealthBook (active, the state of periodic health checks)
    A key turns unhealthy after `unhealthy_threshold` failed checks in a row and healthy again
    after `healthy_threshold` passed checks in a row; one odd result changes nothing.

ActiveHealthChecker (the I/O shell)
    An asyncio task that GETs every target's health URL each `interval_s` and records the
    results in a HealthBook. A check passes on a 2xx answer within `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sites.kits.clock import Clock, SystemClock

__all__ = [
    "ActiveHealthChecker",
    "HealthBook",
    "HealthCheckSettings",
    "HostOutlier",
    "OutlierDetector",
    "OutlierSettings",
    "TargetHealth",
]

log = logging.getLogger(__name__)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OutlierSettings(_Frozen):
    consecutive_failures: int = Field(
        5, ge=1, description="failures in a row that eject an upstream (Envoy's consecutive_5xx)"
    )
    consecutive_connect_failures: int = Field(
        1,
        ge=1,
        description="refused or failed connections in a row that eject an upstream (Envoy's "
        "consecutive_local_origin_failure): nothing is listening, so one is enough",
    )
    base_ejection_time_s: float = Field(
        30.0, gt=0, description="first ejection; the n-th lasts n times as long (Envoy's default)"
    )
    max_ejection_time_s: float = Field(
        300.0, gt=0, description="cap on one ejection, so a recovered site returns (Envoy's)"
    )

    @model_validator(mode="after")
    def _cap_above_base(self) -> OutlierSettings:
        if self.max_ejection_time_s < self.base_ejection_time_s:
            raise ValueError("max_ejection_time_s must be >= base_ejection_time_s")
        return self


@dataclass(frozen=True, slots=True)
class HostOutlier:
    key: str
    consecutive_failures: int = 0
    times_ejected: int = 0
    ejected_until: float | None = None  # None while not ejected
    decay_from: float | None = None  # when the current un-ejected stretch began


class OutlierDetector:
    """Passive outlier ejection per upstream key; see the module docstring."""

    def __init__(self, *, settings: OutlierSettings | None = None) -> None:
        self.settings = settings or OutlierSettings()
        self._hosts: dict[str, HostOutlier] = {}
        self._ejections_end = -math.inf  # no key is ejected from then on (an upper bound)

    def report(self, key: str, ok: bool, now: float, *, connect_failure: bool = False) -> bool:
        """Record one attempt's outcome; True when this report ejected the key."""
        host = self._advance(self._hosts.get(key) or HostOutlier(key), now)
        ejected = False
        if host.ejected_until is not None:
            pass  # in flight before the ejection; the ejection already decided
        elif ok:
            if host.consecutive_failures:  # the common case is a run of successes: no copy
                host = replace(host, consecutive_failures=0)
        else:
            failures = host.consecutive_failures + 1
            threshold = (
                self.settings.consecutive_connect_failures
                if connect_failure
                else self.settings.consecutive_failures
            )
            if failures >= threshold:
                times = host.times_ejected + 1
                duration = min(
                    self.settings.base_ejection_time_s * times, self.settings.max_ejection_time_s
                )
                host = replace(
                    host,
                    consecutive_failures=0,
                    times_ejected=times,
                    ejected_until=now + duration,
                    decay_from=None,
                )
                ejected = True
                self._ejections_end = max(self._ejections_end, now + duration)
                log.warning("upstream %s ejected for %.1f s (ejection %d)", key, duration, times)
            else:
                host = replace(host, consecutive_failures=failures)
        self._hosts[key] = host
        return ejected

    def ejecting(self, now: float) -> bool:
        """Whether any key may be ejected at `now` (False: none is; one comparison, so that a
        request pays nothing for ejections while there are none)."""
        return now < self._ejections_end

    def is_ejected(self, key: str, now: float) -> bool:
        return now < self._ejections_end and self.ejected_until(key, now) is not None

    def ejected_until(self, key: str, now: float) -> float | None:
        host = self._hosts.get(key)
        if host is None or host.ejected_until is None or now >= host.ejected_until:
            return None
        return host.ejected_until

    def ejections(self, now: float) -> dict[str, float]:
        """Every key ejected at `now`, with the time its ejection ends."""
        return {
            key: h.ejected_until
            for key, h in self._hosts.items()
            if h.ejected_until is not None and now < h.ejected_until
        }

    def state(self, key: str, now: float) -> HostOutlier:
        host = self._advance(self._hosts.get(key) or HostOutlier(key), now)
        self._hosts[key] = host
        return host

    def states(self, now: float) -> list[HostOutlier]:
        return [self.state(key, now) for key in sorted(self._hosts)]

    def forget(self, key: str) -> None:
        self._hosts.pop(key, None)

    def _advance(self, host: HostOutlier, now: float) -> HostOutlier:
        """Bring a host's state up to `now`: end a finished ejection, decay the multiplier."""
        if host.ejected_until is not None:
            if now < host.ejected_until:
                return host
            host = replace(host, ejected_until=None, decay_from=host.ejected_until)
        if host.times_ejected == 0:
            return host
        if host.decay_from is None:
            return replace(host, decay_from=now)
        base = self.settings.base_ejection_time_s
        steps = math.floor((now - host.decay_from) / base)
        if steps <= 0:
            return host
        left = max(0, host.times_ejected - steps)
        return replace(
            host,
            times_ejected=left,
            decay_from=None if left == 0 else host.decay_from + steps * base,
        )


@dataclass(frozen=True, slots=True)
class TargetHealth:
    key: str
    healthy: bool
    consecutive_ok: int = 0
    consecutive_failed: int = 0
    checked_at: float | None = None
    changed_at: float | None = None
    error: str | None = None  # why the last check failed


class HealthBook:
    """Active health-check results per key, with hysteresis; see the module docstring."""

    def __init__(
        self,
        *,
        healthy_threshold: int = 2,
        unhealthy_threshold: int = 3,
        initially_healthy: bool = True,
    ) -> None:
        if healthy_threshold < 1 or unhealthy_threshold < 1:
            raise ValueError("healthy_threshold and unhealthy_threshold must be >= 1")
        self.healthy_threshold = healthy_threshold
        self.unhealthy_threshold = unhealthy_threshold
        self.initially_healthy = initially_healthy
        self._targets: dict[str, TargetHealth] = {}

    def record(self, key: str, ok: bool, now: float, error: str | None = None) -> bool:
        """Record one check; True when it changed the key's health."""
        old = self._targets.get(key) or TargetHealth(key, self.initially_healthy)
        if ok:
            passed = old.consecutive_ok + 1
            healthy = old.healthy or passed >= self.healthy_threshold
            new = replace(old, consecutive_ok=passed, consecutive_failed=0, error=None)
        else:
            failed = old.consecutive_failed + 1
            healthy = old.healthy and failed < self.unhealthy_threshold
            new = replace(old, consecutive_ok=0, consecutive_failed=failed, error=error)
        changed = healthy != old.healthy
        new = replace(
            new, healthy=healthy, checked_at=now, changed_at=now if changed else old.changed_at
        )
        self._targets[key] = new
        if changed:
            log.warning(
                "upstream %s is now %s%s",
                key,
                "healthy" if healthy else "unhealthy",
                f" ({error})" if error else "",
            )
        return changed

    def is_healthy(self, key: str) -> bool:
        target = self._targets.get(key)
        return self.initially_healthy if target is None else target.healthy

    def retain(self, keys: Iterable[str]) -> None:
        """Forget every key not in `keys` (upstreams that left the federation)."""
        keep = set(keys)
        for key in [k for k in self._targets if k not in keep]:
            del self._targets[key]

    def states(self) -> list[TargetHealth]:
        return [self._targets[key] for key in sorted(self._targets)]


class HealthCheckSettings(_Frozen):
    interval_s: float = Field(5.0, gt=0, description="seconds between rounds of checks")
    timeout_s: float = Field(2.0, gt=0, description="a check slower than this fails")
    healthy_threshold: int = Field(2, ge=1, description="passes in a row to turn healthy")
    unhealthy_threshold: int = Field(3, ge=1, description="failures in a row to turn unhealthy")
    initially_healthy: bool = Field(
        True, description="a new upstream is routable before its first check (the registry "
        "already reports it healthy)",
    )  # fmt: skip


class ActiveHealthChecker:
    """GETs each target's health URL every interval; results go to `book`."""

    def __init__(
        self,
        *,
        targets: Callable[[], Mapping[str, str]],
        session: aiohttp.ClientSession,
        settings: HealthCheckSettings | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings or HealthCheckSettings()
        self.book = HealthBook(
            healthy_threshold=self.settings.healthy_threshold,
            unhealthy_threshold=self.settings.unhealthy_threshold,
            initially_healthy=self.settings.initially_healthy,
        )
        self._targets = targets  # key -> health URL, read afresh each round
        self._session = session
        self._clock: Clock = clock or SystemClock()

    def is_healthy(self, key: str) -> bool:
        return self.book.is_healthy(key)

    def states(self) -> list[TargetHealth]:
        return self.book.states()

    async def check_once(self) -> None:
        """One round: check every target concurrently and record the results."""
        targets = dict(self._targets())
        self.book.retain(targets)
        results = await asyncio.gather(*(self._probe(url) for url in targets.values()))
        now = self._clock.time()
        for key, (ok, error) in zip(targets, results, strict=True):
            self.book.record(key, ok, now, error)

    async def run(self) -> None:
        """Check every interval, until cancelled; run it supervised (sites.kits.tasks)."""
        while True:
            started = self._clock.monotonic()
            await self.check_once()
            elapsed = self._clock.monotonic() - started
            await self._clock.sleep(max(0.0, self.settings.interval_s - elapsed))

    async def _probe(self, url: str) -> tuple[bool, str | None]:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            async with self._session.get(url, timeout=timeout, allow_redirects=False) as resp:
                await resp.read()
                if 200 <= resp.status < 300:
                    return True, None
                return False, f"HTTP {resp.status}"
        except TimeoutError:
            return False, f"no answer within {self.settings.timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
