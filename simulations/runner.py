"""Running scenarios: one in this process, several in parallel processes, with progress bars.

`run_many(scenarios, workers=N)` runs each scenario as its independent parts (the batch jobs,
the inference demand, the autoscaled services: simulations.parts), each in a process of a
simulations.pool.SimPool (spawned, so nothing of this process's state leaks in), merges the
parts, and returns the results in input order; with `cluster=ADDRESS` the parts are tasks of a
Dask cluster (simulations.cluster) instead. Progress comes back over a queue and is drawn as one bar
per scenario on stderr. A scenario that raises stops the whole
run with that error (the others are cancelled): results of a partly failed comparison are not
comparable.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from simulations.arrivals import generate
from simulations.parts import Part, merge, split, worth_a_process
from simulations.pool import SimPool, Task
from simulations.report import slug
from simulations.scenario import Scenario

__all__ = ["default_out", "run_many"]

_PARTS = tuple(Part)  # a task's key: its scenario's index x len(_PARTS) + its part's


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


def run_many(
    scenarios: Sequence[Scenario],
    *,
    files: Sequence[str | None] | None = None,
    workers: int | None = None,
    progress: bool = False,
    cluster: str | None = None,
) -> list[dict[str, Any]]:
    """Run the scenarios, each as its independent parts (simulations.parts) in parallel
    processes, or as tasks of the Dask cluster at `cluster` (simulations.cluster); results in
    input order."""
    if not scenarios:
        return []
    paths = list(files) if files is not None else [None] * len(scenarios)
    tasks = [
        Task(key=len(_PARTS) * i + _PARTS.index(part), scenario=scenario, part=part, file=path)
        for i, (scenario, path) in enumerate(zip(scenarios, paths, strict=True))
        for part in _parts(scenario, single=len(scenarios) == 1)
    ]
    count = workers or min(len(tasks), os.cpu_count() or 1)
    with _progress([s.name for s in scenarios], progress) as update:

        def on_progress(key: int, fraction: float) -> None:
            scenario, part = divmod(key, len(_PARTS))
            if _PARTS[part] in (Part.all, Part.batch):  # the bar follows the longest part
                update(scenario, fraction)

        def on_done(task: Task, _results: dict[str, Any]) -> None:
            on_progress(task.key, 1.0)

        # one scenario: its batch part (the longest) runs here while workers run the others
        local = cluster is None and len(scenarios) == 1 and len(tasks) > 1 and count > 1
        here = 0 if local else None
        processes = min(count, len(tasks)) - (1 if here is not None else 0)
        with SimPool(
            processes, cluster=cluster, on_progress=on_progress, spawn=here is not None
        ) as pool:
            results = pool.run(tasks, on_done, here=here)
    by_scenario: list[dict[Part, dict[str, Any]]] = [{} for _ in scenarios]
    for task, got in zip(tasks, results, strict=True):
        by_scenario[task.key // len(_PARTS)][task.part] = got
    out = []
    for parts, path in zip(by_scenario, paths, strict=True):
        merged = merge(parts)
        merged["scenario"]["file"] = path
        out.append(merged)
    return out


def _parts(scenario: Scenario, *, single: bool) -> tuple[Part, ...]:
    """The parts to run a scenario as (simulations.parts.split); one scenario alone is run
    whole in this process when its parts are too small to be worth a worker's start."""
    parts = split(scenario)
    if single and parts == (Part.batch, Part.inference):
        jobs = len(
            generate(
                scenario.batch_workloads,
                horizon_s=float(scenario.horizon),
                seed=scenario.seed,
                base_dir=Path(scenario.base_dir),
            )
        )
        if not worth_a_process(scenario, jobs):
            return (Part.all,)
    return parts


def default_out(name: str) -> Path:
    return Path("sim-out") / slug(name)
