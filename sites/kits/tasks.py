"""Supervised tasks: the one way a broker, an agent or the launcher runs a long-lived loop.

Modelled on kopf's guarded tasks: every task is named, its crash is logged with the traceback
and kept (`Supervisor.crashes`), the owner is told (`on_crash`, e.g. to give up leadership and
count it in metrics), and then, per task, either

- `restart=Backoff(...)`: the task is started again after a delay that doubles from
  `initial_s` up to `max_s` (reset once a run lasted `reset_after_s`), or
- `restart=None`: the supervisor fails (`failed` is set, `fatal` holds the crash), and its
  owner exits non-zero.

A root task that returns on its own is treated like a crash (a loop that must run forever
stopped). `healthy` is False while a task is down (between a crash and its restart), for
`unhealthy_s` after any crash (so a probe that polls every few seconds still sees it), and
for good once the supervisor failed. Cancellation is never a crash.

Stopping is bounded: a task still running `stop_grace_s` after it was cancelled is cancelled
once more (a cancellation can be lost: 3.11's `asyncio.wait_for`, which aetcd uses, returns a
result that lands as the cancellation does, and the task runs on as if never asked), and one
still running `stop_grace_s` after that is named in a warning and left, so `stop()` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Backoff", "Crash", "Supervisor", "measure_loop_lag"]

log = logging.getLogger(__name__)

Factory = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Restart delays: initial_s, doubling up to max_s; reset after a run of reset_after_s."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not (0 <= self.initial_s <= self.max_s) or self.reset_after_s < 0:
            raise ValueError(f"invalid backoff {self}")

    def delay_s(self, crashes_in_a_row: int) -> float:
        return float(min(self.max_s, self.initial_s * 2 ** max(0, crashes_in_a_row - 1)))


@dataclass(frozen=True, slots=True)
class Crash:
    task: str
    at: float  # wall clock, unix seconds
    error: str  # "ExcType: message"
    traceback: str
    restart_in_s: float | None  # None: not restarted (the supervisor failed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "at": self.at,
            "error": self.error,
            "restart_in_s": self.restart_in_s,
        }


@dataclass(slots=True)
class _Entry:
    name: str
    factory: Factory
    restart: Backoff | None
    task: asyncio.Task[None] | None = None
    down: bool = False
    crashes: int = 0  # in a row
    total_crashes: int = 0
    last_crash: float | None = None  # monotonic


@dataclass
class Supervisor:
    """Runs named tasks; see the module docstring. `owner` prefixes the task names."""

    owner: str
    on_crash: Callable[[Crash], Coroutine[Any, Any, None] | None] | None = None
    unhealthy_s: float = 30.0
    keep: int = 20  # crashes remembered
    # seconds stop() waits for cancelled tasks, twice at most (module docstring); longer than
    # any task's own bounded cleanup (a watch's cancel waits up to 1 s, sites.registry.client)
    stop_grace_s: float = 5.0
    monotonic: Callable[[], float] = time.monotonic
    crashes: deque[Crash] = field(init=False)
    failed: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    fatal: Crash | None = field(init=False, default=None)
    _entries: dict[str, _Entry] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.crashes = deque(maxlen=self.keep)

    def spawn(self, name: str, factory: Factory, *, restart: Backoff | None = None) -> None:
        """Start `factory()` as task `name`; a second task of the same name is a bug."""
        if name in self._entries:
            raise ValueError(f"{self.owner}: a task named {name!r} already runs")
        entry = _Entry(name, factory, restart)
        self._entries[name] = entry
        entry.task = asyncio.create_task(self._run(entry), name=f"{self.owner} {name}")

    @property
    def healthy(self) -> bool:
        if self.failed.is_set():
            return False
        now = self.monotonic()
        for entry in self._entries.values():
            if entry.down:
                return False
            if entry.last_crash is not None and now - entry.last_crash < self.unhealthy_s:
                return False
        return True

    def status(self) -> dict[str, Any]:
        """For /healthz: healthy, each task's state and crash count, the recent crashes."""
        return {
            "healthy": self.healthy,
            "tasks": {
                e.name: {
                    "state": "failed"
                    if self.fatal is not None and self.fatal.task == e.name
                    else ("down" if e.down else "running"),
                    "crashes": e.total_crashes,
                }
                for e in self._entries.values()
            },
            "recent_crashes": [c.as_dict() for c in self.crashes],
        }

    async def cancel(self, name: str) -> None:
        """Stop one task (no-op when it is not running) and wait for it."""
        entry = self._entries.pop(name, None)
        if entry is None or entry.task is None:
            return
        await self._halt({name: entry.task})

    async def stop(self) -> None:
        """Cancel every task and wait for them (idempotent), at most 2 x stop_grace_s."""
        tasks = {e.name: e.task for e in self._entries.values() if e.task is not None}
        self._entries.clear()
        await self._halt(tasks)

    async def _halt(self, tasks: dict[str, asyncio.Task[None]]) -> None:
        """Cancel `tasks` and wait for them; again for those a cancellation did not stop."""
        names = {task: name for name, task in tasks.items()}
        pending = set(names)
        for attempt in (1, 2):
            for task in pending:
                task.cancel()
            if not pending:
                break
            _, pending = await asyncio.wait(pending, timeout=self.stop_grace_s)
            for task in pending:
                log.warning(
                    "%s %s: still running %.1fs after it was cancelled; %s",
                    self.owner,
                    names[task],
                    self.stop_grace_s,
                    "cancelling it again" if attempt == 1 else "left running",
                )
        for task in names:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, so asyncio does not report it as never retrieved

    async def _run(self, entry: _Entry) -> None:
        while True:
            started = self.monotonic()
            try:
                await entry.factory()
                error: BaseException = RuntimeError("ended on its own; it must run until stopped")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the guard itself: logged, kept, surfaced
                error = exc
            if entry.restart is not None and self.monotonic() - started >= (
                entry.restart.reset_after_s
            ):
                entry.crashes = 0
            entry.crashes += 1
            entry.total_crashes += 1
            entry.last_crash = self.monotonic()
            entry.down = True
            delay = None if entry.restart is None else entry.restart.delay_s(entry.crashes)
            crash = Crash(
                task=entry.name,
                at=time.time(),
                error=f"{type(error).__name__}: {error}",
                traceback="".join(traceback.format_exception(error)),
                restart_in_s=delay,
            )
            self.crashes.append(crash)
            log.error(
                "%s %s crashed%s",
                self.owner,
                entry.name,
                "" if delay is None else f"; restarting in {delay:.1f}s",
                exc_info=error,
            )
            await self._tell(crash)
            if delay is None:
                self.fatal = self.fatal or crash
                self.failed.set()
                return
            await asyncio.sleep(delay)
            entry.down = False

    async def _tell(self, crash: Crash) -> None:
        if self.on_crash is None:
            return
        try:
            result = self.on_crash(crash)
            if result is not None:
                await result
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failing crash hook must not hide the crash
            log.exception("%s: the crash handler for %s failed", self.owner, crash.task)


LOOP_LAG_EVERY_S = 0.05


async def measure_loop_lag(
    observe: Callable[[float], None], every_s: float = LOOP_LAG_EVERY_S
) -> None:
    """Forever: sleep `every_s` and `observe` how much later than asked the loop woke this
    task (seconds). What a request that came in at a random moment waits for the loop before
    its handler runs, sampled: Node's monitorEventLoopDelay, cheaply (20 wakes a second)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + every_s
        await asyncio.sleep(every_s)
        observe(max(0.0, loop.time() - asked))
