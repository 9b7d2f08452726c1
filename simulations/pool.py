"""Worker processes for simulations, kept for as long as their user needs them.

`SimPool(workers)` spawns its processes once (spawn: nothing of this process's state leaks in)
and runs `Task`s on them: a scenario, the part of it to run (simulations.parts) and optionally a
`check` that may stop the run once its verdict is known (simulations.capacity). A
planner's search submits a few tasks a round for dozens of rounds: one pool for all of them,
not one per round (spawning and importing the simulator costs about a second a process).

- Progress: each task's fraction of virtual time comes back over one queue, read by
  `poll`/`run`; `on_progress(key, fraction)` draws it.
- Shared figures: `shared` is an array of doubles every worker sees (a search's bar for its
  checks: simulations.capacity), written by the parent with `publish`.
- Ctrl-C stops cleanly: the workers ignore SIGINT, the parent's KeyboardInterrupt terminates
  and joins them (`close(kill=True)`), and the queue is closed and joined: no process and no
  semaphore is left behind (tests/simulations/test_pool.py checks both).
- workers=1 runs the tasks in this process, one after the other (no process at all).

With `cluster=ADDRESS` the tasks go to a Dask cluster instead (simulations.cluster); its
workers see no shared figures (checks then use what they were given at submission) and report
progress only when a task ends.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import secrets
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.pool import Pool
from typing import Any

from simulations.engine import Simulation
from simulations.parts import Part
from simulations.scenario import Scenario

__all__ = ["SHARED_SLOTS", "SimPool", "Task", "shared_figures"]

SHARED_SLOTS = 4  # doubles every worker sees

_updates: Any = None  # the worker's side of the progress queue
_shared: Any = None  # the worker's view of the shared doubles


@dataclass(frozen=True)
class Task:
    """One simulation to run: `key` names it in progress and results."""

    key: int
    scenario: Scenario
    part: Part = Part.all
    check: Callable[[Simulation], str | None] | None = None
    file: str | None = None


def shared_figures() -> Sequence[float] | None:
    """In a worker, the doubles the parent published (None: in no pool, or a Dask worker)."""
    shared: Sequence[float] | None = _shared
    return shared


def _init(updates: Any, shared: Any) -> None:
    global _updates, _shared
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the pool on Ctrl-C
    _updates, _shared = updates, shared


def _simulate(task: Task, report: Callable[[float], None]) -> dict[str, Any]:
    results = Simulation(task.scenario, part=task.part).run(report, task.check)
    if "scenario" in results:
        results["scenario"]["file"] = task.file
    return results


def run_task(task: Task) -> dict[str, Any]:
    """Run one task in a worker (a pool's or a Dask cluster's): progress over the queue."""

    def report(fraction: float) -> None:
        if _updates is not None:
            try:
                _updates.put_nowait((task.key, fraction))
            except (queue_mod.Full, OSError, ValueError):
                pass  # progress is best effort

    return _simulate(task, report)


class _DaskTask:
    """A task on a Dask cluster, with the ready()/get() of a local AsyncResult."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def ready(self) -> bool:
        return bool(self.future.done())

    def get(self) -> dict[str, Any]:
        if self.future.status == "error":
            raise self.future.exception()
        results: dict[str, Any] = self.future.result()
        return results


class SimPool:
    """Processes that run `Task`s (module docstring); a context manager."""

    def __init__(
        self,
        workers: int | None = None,
        *,
        cluster: str | None = None,
        on_progress: Callable[[int, float], None] | None = None,
        spawn: bool = False,
    ) -> None:
        """`workers` processes (default: one per CPU; 1: none, the tasks run in this process,
        unless `spawn`)."""
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.on_progress = on_progress
        self._pool: Pool | None = None
        self._updates: Any = None
        self._client: Any = None  # a Dask cluster's (cluster=ADDRESS)
        self.shared: Any = None
        self.ran = 0  # tasks run
        self._run_id = secrets.token_hex(4)
        if cluster is not None:
            from simulations.cluster import connect

            self._client = connect(cluster)
            self.shared = [0.0] * SHARED_SLOTS  # the workers see none of it
        elif self.workers > 1 or spawn:
            ctx = mp.get_context("spawn")
            self._updates = ctx.Queue()
            self.shared = ctx.Array("d", SHARED_SLOTS, lock=False)
            self._pool = ctx.Pool(self.workers, _init, (self._updates, self.shared))
        else:
            self.shared = [0.0] * SHARED_SLOTS
            global _shared
            _shared = self.shared

    def __enter__(self) -> SimPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(kill=kind is not None)

    def publish(self, values: Sequence[float]) -> None:
        """Set the shared doubles (the workers read them at their next check)."""
        for i, v in enumerate(values[:SHARED_SLOTS]):
            self.shared[i] = v

    def submit(self, task: Task) -> Any:
        """Start `task`: a handle for `run` (or, in-process, its results at once)."""
        self.ran += 1
        if self._client is not None:
            key = f"cpn-simulate-{self._run_id}-{self.ran}"
            return _DaskTask(self._client.submit(run_task, task, key=key, pure=False))
        if self._pool is None:
            return self._here(task)
        return self._pool.apply_async(run_task, (task,))

    def _here(self, task: Task) -> dict[str, Any]:
        on = self.on_progress

        def report(fraction: float) -> None:
            if on is not None:
                on(task.key, fraction)

        return _simulate(task, report)

    def poll(self, timeout: float = 0.2) -> None:
        """Wait up to `timeout` for progress and hand it to on_progress."""
        if self._updates is None:
            time.sleep(timeout)  # a cluster's tasks: no progress but their end
            return
        try:
            key, fraction = self._updates.get(timeout=timeout)
        except queue_mod.Empty:
            return
        if self.on_progress is not None:
            self.on_progress(key, fraction)
        while True:
            try:
                key, fraction = self._updates.get_nowait()
            except queue_mod.Empty:
                return
            if self.on_progress is not None:
                self.on_progress(key, fraction)

    def run(
        self,
        tasks: Sequence[Task],
        on_done: Callable[[Task, dict[str, Any]], None] | None = None,
        *,
        here: int | None = None,
    ) -> list[dict[str, Any]]:
        """Run `tasks`, results in their order; `on_done(task, results)` as each ends (in
        the order they end). A task that raises stops the others and raises here. `here`: the
        index of a task to run in this process while the workers run the others (one
        scenario's longest part: no worker to spawn and no results to send back for it)."""
        if self._pool is None and self._client is None:  # in this process, one by one
            done = []
            for task in tasks:
                got = self.submit(task)
                if on_done is not None:
                    on_done(task, got)
                done.append(got)
            return done
        handles: list[Any] = [None if i == here else self.submit(t) for i, t in enumerate(tasks)]
        if here is not None:
            handles[here] = self._here(tasks[here])
        out: list[dict[str, Any] | None] = [None] * len(tasks)
        left = set(range(len(tasks)))
        while left:
            for i in sorted(left):
                handle = handles[i]
                if isinstance(handle, dict):
                    out[i] = handle
                elif handle.ready():
                    out[i] = handle.get()  # raises the task's error
                else:
                    continue
                left.discard(i)
                if on_done is not None:
                    on_done(tasks[i], out[i] or {})
            if left:
                self.poll()
        return [r or {} for r in out]

    def close(self, kill: bool = False) -> None:
        """Stop the workers (kill: at once, e.g. on Ctrl-C) and release the queue."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            if kill:
                pool.terminate()
            else:
                pool.close()
            pool.join()
        global _shared
        if _shared is self.shared:
            _shared = None
        updates, self._updates = self._updates, None
        if updates is not None:
            updates.close()
            updates.join_thread()
