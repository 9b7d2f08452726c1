"""The simulator's victim index: the live runs by site as broker.placement.preemption weighs
them, kept up to date as runs start and stop, where a pass used to rebuild them all.

A pass asks two things of the live runs (broker.placement.preemption.Victims): each site's
floor (its lowest priority and whether best-effort work runs there), for every candidate
site of every job that may preempt; and a site's victim units, cheapest first, for the sites
a preemption is planned at. Rebuilt at each pass from every live run, that was most of a
simulation's time (a Running and a Unit per live job, hundreds of thousands of passes a
simulated week). `LiveRuns` keeps, per site, the priorities of its runs (counted: the floor is
the lowest key) and one Running and one Unit per run, made when the run starts. The one field
that moves with time, the work a run would lose if stopped now (`lost_s`), is brought up to
the pass's instant when the site's units are asked for, in place (see `_Entry.refresh`), and
the site's list is sorted again by `Unit.order`, which Timsort does in linear time on a list
already nearly in order. A site's units are rebuilt only where something ran or stopped.

What a pass sees is what the rebuilt index showed it (`PassRuns`): the runs live at the
pass's start, not those it placed (their starts reach the index when the pass ends), without
its victims once preempted; a site's floor as it was at the pass's start (the rebuilt index
never lowered it after a preemption, and the pass counts its tries by it). A test runs the
shipped scenarios and random ones both ways and compares the results byte for byte
(tests/simulations/test_victims.py); `Simulation(rebuild=True)` is the old way.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from broker.placement.preemption import Running, Unit, lost_s

__all__ = ["LiveRuns", "PassRuns"]

_set = object.__setattr__  # Running and Unit are frozen: the index alone moves their lost_s


class _Entry:
    """One live run: its Running and Unit, and what its work lost and its order derive from."""

    __slots__ = ("checkpoint_s", "ids", "order_rest", "priority", "running", "start", "unit")

    def __init__(self, running: Running, start: float, checkpoint_s: float) -> None:
        self.running = running
        self.unit = unit = Unit.of((running,))
        self.start = start
        self.checkpoint_s = checkpoint_s
        # Unit.order's parts that do not move with time
        self.priority = unit.priority
        self.order_rest = (unit.cost_usd, sum(unit.by_model.values()))
        self.ids = tuple(m.id for m in unit.members)

    def refresh(self, now: float) -> None:
        """The work lost if stopped at `now`, as `Unit.of` and the Running's maker compute it
        (broker.placement.preemption.lost_s), set in place: the objects are the index's own,
        and a pass that made a Preemption of them is over before the next refresh."""
        lost = lost_s(now - self.start, self.checkpoint_s)
        _set(self.running, "lost_s", lost)
        _set(self.unit, "lost_s", 0 + lost)  # float(sum(...)) of one float, as Unit.of

    def order(self) -> tuple[int, float, float, int, tuple[str, ...]]:
        """`Unit.order` of its unit."""
        cost, gpus = self.order_rest
        return self.priority, self.unit.lost_s, cost, gpus, self.ids


class LiveRuns:
    """The live runs by site (module docstring). `add` and `remove` as runs start and stop;
    `open` and `close` around each pass."""

    def __init__(self) -> None:
        self._sites: dict[str, dict[int, _Entry]] = {}
        self._priorities: dict[str, dict[int, int]] = {}  # site -> priority -> runs
        self._best_effort: dict[str, int] = {}  # site -> best-effort runs
        self._tenants: dict[str, dict[str, int]] = {}  # site -> tenant -> runs
        self._order: dict[str, list[_Entry]] = {}  # site -> its entries, cheapest first at...
        self._at: dict[str, float] = {}  # ... this instant (absent: to be built again)
        self.version: dict[str, int] = {}  # site -> changes to its runs
        self._view: PassRuns | None = None
        self._deferred: list[tuple[int, Running, float, float]] = []

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._sites.values())

    def add(self, j: int, running: Running, start: float, checkpoint_s: float) -> None:
        """Run j started (`running`: as preemption weighs it; its lost_s is set when asked).
        While a pass is open its starts wait for `close` (a pass weighs the runs before it)."""
        if self._view is not None:
            self._deferred.append((j, running, start, checkpoint_s))
            return
        site = running.site
        self._touch(site)
        self._sites.setdefault(site, {})[j] = _Entry(running, start, checkpoint_s)
        counts = self._priorities.setdefault(site, {})
        counts[running.priority] = counts.get(running.priority, 0) + 1
        if running.best_effort:
            self._best_effort[site] = self._best_effort.get(site, 0) + 1
        tenants = self._tenants.setdefault(site, {})
        tenants[running.tenant] = tenants.get(running.tenant, 0) + 1

    def remove(self, j: int, site: str) -> None:
        """Run j stopped (finished, failed, moved or preempted); no-op for one not indexed."""
        entries = self._sites.get(site)
        if entries is None or j not in entries:
            for k, (other, *_) in enumerate(self._deferred):
                if other == j:
                    del self._deferred[k]
                    return
            return
        self._touch(site)
        running = entries.pop(j).running
        counts = self._priorities[site]
        counts[running.priority] -= 1
        if not counts[running.priority]:
            del counts[running.priority]
        if running.best_effort:
            self._best_effort[site] -= 1
        tenants = self._tenants[site]
        tenants[running.tenant] -= 1
        if not tenants[running.tenant]:
            del tenants[running.tenant]
        if not entries:
            del self._sites[site], self._priorities[site], self._tenants[site]
            self._best_effort.pop(site, None)

    def _touch(self, site: str) -> None:
        if self._view is not None:
            self._view.keep_floor(site)  # the pass goes on with the floor it started with
        self._at.pop(site, None)
        self.version[site] = self.version.get(site, 0) + 1

    def floor_at(self, site: str) -> tuple[int, bool] | None:
        counts = self._priorities.get(site)
        if not counts:
            return None
        return min(counts), self._best_effort.get(site, 0) > 0

    def tenants_at(self, site: str) -> Collection[str]:
        return self._tenants.get(site, {}).keys()

    def units(self, site: str, now: float) -> list[Unit]:
        """The site's victim units at `now`, cheapest first: a new list each time."""
        entries = self._sites.get(site)
        if not entries:
            return []
        at = self._at.get(site)
        if at != now:
            order = self._order.get(site) if at is not None else None
            if order is None:  # its runs changed: in start order, nearly sorted already
                order = list(entries.values())
            for entry in order:
                entry.refresh(now)
            order.sort(key=_Entry.order)
            self._order[site] = order
            self._at[site] = now
        return [entry.unit for entry in self._order[site]]

    def open(self, now: float) -> PassRuns:
        """A pass at `now` begins: what it weighs (module docstring); `close` when it ends."""
        self._view = PassRuns(self, now)
        return self._view

    def close(self) -> None:
        """The pass ended: the runs it started join the index."""
        self._view = None
        deferred, self._deferred = self._deferred, []
        for j, running, start, checkpoint_s in deferred:
            self.add(j, running, start, checkpoint_s)


class PassRuns:
    """broker.placement.preemption.Victims for one pass over a LiveRuns (module docstring)."""

    __slots__ = ("_floors", "_index", "_units", "now")

    def __init__(self, index: LiveRuns, now: float) -> None:
        self._index = index
        self.now = now
        self._floors: dict[str, tuple[int, bool] | None] = {}
        self._units: dict[str, tuple[int, list[Unit]]] = {}

    def keep_floor(self, site: str) -> None:
        """The index is about to change `site`: this pass keeps the floor it saw there."""
        if site not in self._floors:
            self._floors[site] = self._index.floor_at(site)

    def floor_at(self, site: str) -> tuple[int, bool] | None:
        if site in self._floors:
            return self._floors[site]
        return self._index.floor_at(site)

    def tenants_at(self, site: str) -> Collection[str]:
        return self._index.tenants_at(site)

    def at(self, site: str) -> list[Unit]:
        version = self._index.version.get(site, 0)
        kept = self._units.get(site)
        if kept is not None and kept[0] == version:
            return kept[1]
        units = self._index.units(site, self.now)
        self._units[site] = (version, units)
        return units

    def without(self, gone: Iterable[Running]) -> None:
        """Nothing to do: the host removes preempted runs from the index as it stops them."""
