"""The leader's back-off from a site where attempts keep failing to start.

A run that fails before it started (its report `failed` with no `started_at`: the site's
executor refused it: Slurm's controller unreachable, sbatch refusing, the sandbox or the work
dir broken since the agent started) sends that job's retry elsewhere when another site fits
(broker.leader.fast_path._elsewhere). Other jobs would still be placed there and fail the same
way. So the leader counts, per site, the attempts that failed to start there: `start_failures`
of them within `start_failure_window_s`, with no run started there meanwhile, and it cordons
the site for a back-off (an automatic cordon: sites.model.status.Cordon with `until`), which
`cpn sites` and the dashboard show with its reason and which raises the `site_backing_off`
alert. Placement leaves a cordoned site alone, so the work goes elsewhere; when the back-off
ends the leader lifts the cordon and the next job placed there is the probe: a run that starts
there forgets the site's failures, another streak of failures backs off twice as long
(`start_backoff_s` doubling up to `start_backoff_max_s`).

The counts are the leader's memory (a new leader starts from none: at worst a few more
attempts fail before it backs off again); the cordon is in etcd, so any leader lifts it. An
operator's cordon (`cpn site leave`) is never replaced nor lifted by this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from broker.placement.settings import SchedulingSettings
from sites.model.status import Cordon

__all__ = ["BACKING_OFF", "StartBackoff", "StartFailure", "expired"]

BACKING_OFF = "backing off"
"""How an automatic cordon's reason starts."""


@dataclass(frozen=True, slots=True)
class StartFailure:
    """An attempt of `job` that failed at `site` before it started, and why."""

    job: str
    attempt: int
    site: str
    why: str


class StartBackoff:
    """Per site: the attempts that failed to start lately, and how many back-offs in a row."""

    def __init__(self) -> None:
        # site -> (job, attempt) -> (when, why): an attempt counts once, however many passes
        # decide on its report before the write commits
        self._failed: dict[str, dict[tuple[str, int], tuple[float, str]]] = {}
        self._level: dict[str, int] = {}  # back-offs in a row, without a run started between

    def observe(
        self,
        failed: Iterable[StartFailure],
        started: Iterable[str],
        now: float,
        settings: SchedulingSettings,
    ) -> list[tuple[str, Cordon]]:
        """What a pass wrote: attempts that failed to start, sites where a run started. The
        automatic cordons to put: (site, cordon) for each site whose failures reached
        `start_failures` in the window."""
        for site in started:
            self._failed.pop(site, None)
            self._level.pop(site, None)
        touched = set()
        for f in failed:
            self._failed.setdefault(f.site, {})[(f.job, f.attempt)] = (now, f.why)
            touched.add(f.site)
        if settings.start_failures <= 0:
            return []
        window = settings.start_failure_window_s
        out = []
        for site in sorted(touched):
            streak = self._failed[site]
            for key in [k for k, (at, _) in streak.items() if now - at > window]:
                del streak[key]
            if len(streak) < settings.start_failures:
                continue
            level = self._level.get(site, 0)
            seconds = min(settings.start_backoff_s * 2**level, settings.start_backoff_max_s)
            self._level[site] = level + 1
            last = max(streak.values())[1]
            reason = (
                f"{BACKING_OFF} for {_span(seconds)}: {len(streak)} attempts failed to start "
                f"here within {_span(window)}, none started; the last: {last}"
            )
            streak.clear()
            out.append((site, Cordon(since=now, reason=reason[:500], until=now + seconds)))
        return out


def expired(cordons: Mapping[str, Cordon], now: float) -> list[tuple[str, float]]:
    """(site, until) of the automatic cordons whose back-off is over."""
    return [
        (site, c.until) for site, c in sorted(cordons.items())
        if c.until is not None and c.until <= now
    ]  # fmt: skip


def _span(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
