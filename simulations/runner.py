"""Running scenarios: one in this process, several in parallel processes, with progress bars.

`run_many(scenarios, workers=N)` runs each scenario in its own process (spawned, so nothing of
this process's state leaks in), or with `cluster=ADDRESS` as a task of a Dask cluster
(simulations.cluster), and returns the results in input order; progress comes back over
a queue and is drawn as one bar per scenario on stderr. A scenario that raises stops the whole
run with that error (the others are cancelled): results of a partly failed comparison are not
comparable.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue as queue_mod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from simulations.engine import Simulation
from simulations.report import slug
from simulations.scenario import Scenario

__all__ = ["default_out", "run_many"]


def _bar(console: Console | None) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f} % of virtual time"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        transient=False,
    )


@contextlib.contextmanager
def _progress(
    names: Sequence[str], show: bool, console: Console | None = None
) -> Iterator[Callable[[int, float], None]]:
    if not show:
        yield lambda _i, _f: None
        return
    with _bar(console) as bar:
        tasks = [bar.add_task(name, total=1.0) for name in names]
        yield lambda i, fraction: bar.update(tasks[i], completed=fraction)


def _worker(scenario: Scenario, index: int, file: str | None, updates: Any) -> dict[str, Any]:
    def report(fraction: float) -> None:
        with contextlib.suppress(Exception):  # progress is best effort
            updates.put((index, fraction))

    results = Simulation(scenario).run(report if updates is not None else None)
    results["scenario"]["file"] = file
    return results


def run_many(
    scenarios: Sequence[Scenario],
    *,
    files: Sequence[str | None] | None = None,
    workers: int | None = None,
    progress: bool = False,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """Run the scenarios in parallel processes, or as tasks of the Dask cluster at `cluster`
    (simulations.cluster); results in input order."""
    if not scenarios:
        return []
    paths = list(files) if files is not None else [None] * len(scenarios)
    if cluster is not None:
        from simulations.cluster import run_on_cluster

        with _progress([s.name for s in scenarios], progress) as update:
            return run_on_cluster(scenarios, paths, cluster, update)
    count = workers or min(len(scenarios), os.cpu_count() or 1)
    if count <= 1 or len(scenarios) == 1:
        with _progress([s.name for s in scenarios], progress) as update:
            out = []
            for i, (scenario, path) in enumerate(zip(scenarios, paths, strict=True)):
                results = Simulation(scenario).run(functools.partial(update, i))
                results["scenario"]["file"] = path
                out.append(results)
            return out
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(count, mp_context=ctx) as pool:
        updates = manager.Queue() if progress else None
        futures = [
            pool.submit(_worker, scenario, i, path, updates)
            for i, (scenario, path) in enumerate(zip(scenarios, paths, strict=True))
        ]
        with _progress([s.name for s in scenarios], progress) as update:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
                for future in done:
                    if future.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise future.exception()  # type: ignore[misc]
                    update(futures.index(future), 1.0)
                while updates is not None:
                    try:
                        index, fraction = updates.get_nowait()
                    except queue_mod.Empty:
                        break
                    update(index, fraction)
        return [f.result() for f in futures]


def default_out(name: str) -> Path:
    return Path("sim-out") / slug(name)
