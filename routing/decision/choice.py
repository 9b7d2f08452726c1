"""Choosing one site from a ranking (routing.decision.selection.rank): p2c, hysteresis, affinity.
Pure.

choose(ranking, rng=..., key=..., previous=..., <band, hysteresis, slack>) -> Choice | None
(the band, hysteresis and slack come from routing.decision.policy.RoutingSettings, whose route() is
the whole gateway policy built on rank and choose: in-flight merge, hysteresis state,
overflow.)
near-best pool: ranked candidates with total_ms <= best + max(near_best_ms,
near_best_ratio * best). A site outside it is never chosen.
- key given (session affinity): rendezvous (HRW) hashing of the key over the AFFINITY pool,
  every ranked candidate with total_ms <= best + affinity_slack_ms (None: all of them), i.e.
  every acceptable site, not only the near-best. Each (key, site) gets a fixed pseudo-random
  weight (blake2b) and the heaviest site wins, so adding or removing a site moves only the
  keys that hash to that site; load changes inside the slack move none. If `previous` (the
  site the session is on) is in the pool it is kept, so a session that moved during an
  outage does not move back.
- else prefix_key given (prefix-cache affinity): the key's home is the rendezvous winner
  among the PREFIX pool, every ranked candidate whose idle score (total_ms less its wait
  and kv_ms: what it would score unloaded) is within affinity_slack_ms of the best idle
  score, a set that load does not change. The home is chosen (mode prefix) while its
  total_ms <= best + prefix_slack_ms, i.e. while its load allows; else the request spills
  to the ordinary choice below, without hysteresis, and the Choice names the home.
- else previous given (hysteresis): keep it while its total_ms <= best + hysteresis_ms.
- else power of two choices: draw two distinct sites of the near-best pool and take the less
  loaded ((in_flight + queue) / max_concurrency, then total_ms; on a tie the first drawn), so
  equal sites share the load instead of herding to the lowest score, and score noise inside
  the pool changes nothing.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from routing.decision.ranking import Ranking, Scored
from routing.errors import InvalidParameter

__all__ = [
    "Choice",
    "ChoiceMode",
    "Chosen",
    "Row",
    "choice_of",
    "choose",
    "choose_row",
    "hrw_weight",
]


class ChoiceMode(enum.StrEnum):
    single = "single"  # one near-best candidate
    p2c = "p2c"  # power of two choices in the near-best pool
    sticky = "sticky"  # kept the previous site (hysteresis, or the session's current site)
    affinity = "affinity"  # rendezvous hashing of the session key
    prefix = "prefix"  # rendezvous hashing of the prefix key: the prefix's home site


@dataclass(frozen=True, slots=True)
class Choice:
    site: str
    scored: Scored
    mode: ChoiceMode
    pool: tuple[str, ...]  # the sites it was chosen among
    home: str | None = None  # a prefix-keyed request that spilled: its home site


def hrw_weight(key: str, site: str) -> int:
    """The rendezvous weight of (key, site): stable across processes and releases."""
    digest = hashlib.blake2b(f"{key}\x00{site}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose(
    ranking: Ranking,
    *,
    rng: random.Random,
    hysteresis_ms: float,
    near_best_ms: float,
    near_best_ratio: float,
    affinity_slack_ms: float | None,
    key: str | None = None,
    previous: str | None = None,
    prefix_key: str | None = None,
    prefix_slack_ms: float = 0.0,
) -> Choice | None:
    """Pick a site from the ranking (module docstring); None when nothing is ranked.

    The band, hysteresis and affinity slack have no defaults here:
    routing.decision.policy.RoutingSettings
    holds the one set the gateway and the simulator use (prefix_slack_ms has one because only a
    prefix_key reads it). InvalidParameter names a bad one."""
    if prefix_key is not None and not (0 <= prefix_slack_ms < math.inf):
        raise InvalidParameter(
            f"prefix_slack_ms must be a finite number >= 0, got {prefix_slack_ms}",
            field="prefix_slack_ms",
        )
    slack = 0.0 if affinity_slack_ms is None else affinity_slack_ms
    # one chained test per call (a NaN fails every comparison); the loop only to name the field
    if not (
        0 <= hysteresis_ms < math.inf
        and 0 <= near_best_ms < math.inf
        and 0 <= near_best_ratio < math.inf
        and 0 <= slack < math.inf
    ):
        for name, value in (
            ("hysteresis_ms", hysteresis_ms),
            ("near_best_ms", near_best_ms),
            ("near_best_ratio", near_best_ratio),
            ("affinity_slack_ms", slack),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise InvalidParameter(
                    f"{name} must be a finite number >= 0, got {value}", field=name
                )
    rows = ranking.rows
    if not rows:
        return None
    chosen = choose_row(
        rows,
        rng=rng,
        key=key,
        previous=previous,
        hysteresis_ms=hysteresis_ms,
        near_best_ms=near_best_ms,
        near_best_ratio=near_best_ratio,
        affinity_slack_ms=affinity_slack_ms,
        prefix_key=prefix_key,
        prefix_slack_ms=prefix_slack_ms,
    )
    return choice_of(ranking, chosen)


def choice_of(ranking: Ranking, chosen: Chosen[Any]) -> Choice:
    """choose_row's answer on `ranking.rows` as a Choice of the ranking's Scored."""
    row, mode, pool, home = chosen
    rows, ranked, site = ranking.rows, ranking.ranked, row[1]
    # by site, which a ranking holds once: compiled code (routing.native) boxes a row anew
    # each time it hands it over, so `is` would not find it
    scored = next(ranked[i] for i, r in enumerate(rows) if r[1] == site)
    spilled = None if home is None or mode is ChoiceMode.prefix else home[1]
    return Choice(scored.site, scored, mode, tuple(r[1] for r in pool), spilled)


Row = TypeVar("Row", bound=tuple[float, str, float, float, *tuple[object, ...]])
"""A ranked candidate as choose_row reads it: (total_ms, site, load, idle_ms, ...), load being
(in_flight + queue) / max_concurrency and idle_ms Score.idle_ms (routing.decision.selection's
ScoredRow and Ranking.rows)."""


Chosen = tuple[Row, ChoiceMode, Sequence[Row], Row | None]
"""choose_row's answer: the chosen row, how, the rows it was chosen among, the prefix key's
home when there was one."""


def choose_row(
    rows: Sequence[Row],
    *,
    rng: random.Random,
    key: str | None,
    previous: str | None,
    hysteresis_ms: float,
    near_best_ms: float,
    near_best_ratio: float,
    affinity_slack_ms: float | None,
    prefix_key: str | None,
    prefix_slack_ms: float,
) -> Chosen[Row]:
    """choose's steps (module docstring) on rows sorted best first, at least one, with the
    settings already checked (RoutingSettings checks its own). routing.decision.policy's route and
    pick call it: route on its Ranking's rows (then choice_of), pick on score_rows' rows."""
    best = rows[0]
    if key is not None:
        limit = math.inf if affinity_slack_ms is None else best[0] + affinity_slack_ms
        pool = [r for r in rows if r[0] <= limit]
        for r in pool:
            if r[1] == previous:
                return r, ChoiceMode.sticky, pool, None
        winner = max(pool, key=lambda r: (hrw_weight(key, r[1]), r[1]))
        return winner, ChoiceMode.affinity, pool, None
    home: Row | None = None
    if prefix_key is not None:
        if affinity_slack_ms is None:
            homes: Sequence[Row] = rows
        else:
            lowest = min(r[3] for r in rows) + affinity_slack_ms
            homes = [r for r in rows if r[3] <= lowest]
        home = max(homes, key=lambda r: (hrw_weight(prefix_key, r[1]), r[1]))
        if home[0] <= best[0] + prefix_slack_ms:
            return home, ChoiceMode.prefix, homes, home
        previous = None  # a spill is an ordinary choice, without hysteresis
    if previous is not None:
        for r in rows:
            if r[1] == previous:
                if r[0] <= best[0] + hysteresis_ms:
                    return r, ChoiceMode.sticky, (r,), None
                break
    band = max(near_best_ms, near_best_ratio * best[0])
    near = [r for r in rows if r[0] <= best[0] + band]
    if len(near) == 1:
        return best, ChoiceMode.single, near, home
    first, second = rng.sample(near, 2)
    # the less loaded, then the lower total_ms; on a tie the first drawn
    chosen = second if (second[2], second[0]) < (first[2], first[0]) else first
    return chosen, ChoiceMode.p2c, near, home
