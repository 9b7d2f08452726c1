"""`cpn simulate` and `cpn plan-capacity` (docs/simulation.md).

    cpn simulate SCENARIO.yaml [SCENARIO.yaml ...] [--out DIR] [--workers N | --cluster ADDR]
                 [--sweep FIELD=V1,V2,... | --seeds 1,2,3 | --seeds 1-5] [--seed N]
                 [--horizon 7d] [--replicate DATASET=SITE_OR_REGION ...] [--no-progress]
                 [--json]
    cpn plan-capacity PLANNING.yaml [--out FILE] [--workers N | --cluster ADDR] [--no-progress]

Exit 0 when the run finished, 2 with one line per problem for bad input (a scenario or
planning file that does not validate, a bad option), 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml
from rich.console import Console
from rich.table import Table

from simulations import pages, report, spread
from simulations.capacity import load_planning, plan_capacity
from simulations.cluster import ClusterError
from simulations.report import slug
from simulations.runner import default_out, run_many
from simulations.scenario import Scenario, load_scenario
from sites.model.durations import parse_duration_s
from sites.model.errors import ConfigError

__all__ = ["plan_capacity_main", "simulate_main"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _seeds(text: str) -> list[int]:
    """Seeds as 1,2,3 or 1-5 or both (1-3,7): distinct integers >= 0, at least two, in order."""
    seeds: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part, re.ASCII)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"expected seeds such as 1,2,3 or 1-5 (integers >= 0), got {text!r}"
            )
        low, high = int(match[1]), int(match[2] or match[1])
        if high < low:
            raise argparse.ArgumentTypeError(f"the range {part.strip()!r} is empty")
        seeds += range(low, high + 1)
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"seed {repeated[0]} is given twice")
    if len(seeds) < 2:
        raise argparse.ArgumentTypeError("give at least two seeds (one seed is --seed)")
    return seeds


def _parallel(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=_workers, default=None, help="parallel processes")
    where.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="run each scenario as a task of the Dask cluster there, e.g. tcp://host:8786 "
        "(docs/simulation.md)",
    )


def _run(
    prog: str,
    parser: argparse.ArgumentParser,
    argv: list[str],
    command: Callable[[argparse.Namespace], int],
) -> int:
    """Parse and run; bad input is exit 2 with one line per problem, named after `prog`."""
    try:
        return command(parser.parse_args(argv))
    except _UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # the worker processes are stopped already (simulations.pool.SimPool), nothing written
        print(f"{prog}: interrupted; no results written", file=sys.stderr)
        return 130


def _simulate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cpn simulate", description="run capacity-planning simulations")
    p.add_argument("scenarios", nargs="+", help="scenario YAML files")
    p.add_argument("--out", help="report folder (default sim-out/<scenario or 'comparison'>)")
    _parallel(p)
    p.add_argument(
        "--sweep",
        help="FIELD=V1,V2,...: run one scenario once per value of a dotted field "
        "(e.g. policy.kind=fast-path,random or federation.edits.0.add_devices.count=64,128)",
    )
    p.add_argument("--seed", type=int, help="override the scenarios' seed")
    p.add_argument(
        "--seeds",
        type=_seeds,
        help="1,2,3 or 1-5: run one scenario once per seed and print each figure's spread "
        "over them (docs/simulation.md)",
    )
    p.add_argument("--horizon", help="override the scenarios' horizon (e.g. 2d)")
    p.add_argument(
        "--replicate",
        action="append",
        metavar="DATASET=SITE_OR_REGION",
        help="the what-if of one more replica (repeatable): run the scenario as it is and with "
        "the replicas added, side by side (egress, staging, queueing; docs/simulation.md)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the results JSON, not a table")
    return p


def _replicas(texts: list[str]) -> list[dict[str, str]]:
    out = []
    for text in texts:
        dataset, sep, to = text.partition("=")
        if not sep or not dataset.strip() or not to.strip():
            raise _UsageError(f"--replicate {text!r}: expected DATASET=SITE_OR_REGION")
        out.append({"dataset": dataset.strip(), "to": to.strip()})
    return out


def _what_if(path: str, texts: list[str], overrides: dict[str, Any]) -> list[Scenario]:
    """The scenario as it is and with the replicas of --replicate added to its what-if."""
    base = load_scenario(path, overrides)
    added = _replicas(texts)
    kept = [r.model_dump() for r in base.what_if.replicate]
    more = load_scenario(path, {**overrides, "what_if.replicate": kept + added})
    label = ", ".join(f"{r['dataset']} at {r['to']}" for r in added)
    return [base, more.model_copy(update={"name": f"{base.name} + {label}"})]


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.seed is not None:
        out["seed"] = args.seed
    if args.horizon is not None:
        try:
            out["horizon"] = parse_duration_s(args.horizon)
        except ValueError as exc:
            raise _UsageError(f"--horizon: {exc}") from None
    return out


def _sweep(text: str) -> tuple[str, list[Any]]:
    field, sep, values = text.partition("=")
    if not sep or not field.strip() or not values.strip():
        raise _UsageError(f"--sweep {text!r}: expected FIELD=V1,V2,...")
    parsed = [yaml.safe_load(v) for v in values.split(",") if v.strip()]
    if len(parsed) < 2:
        raise _UsageError(f"--sweep {text!r}: give at least two values")
    return field.strip(), parsed


def simulate_main(argv: list[str]) -> int:
    return _run("cpn simulate", _simulate_parser(), argv, _simulate)


def _simulate(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    if args.seeds is not None:
        return _simulate_seeds(args, overrides)
    scenarios: list[Scenario] = []
    files: list[str | None] = []
    sweep: tuple[str, list[Any]] | None = None
    if args.replicate:
        if args.sweep or len(args.scenarios) != 1:
            raise _UsageError("--replicate takes exactly one scenario file, and no --sweep")
        scenarios = _what_if(args.scenarios[0], args.replicate, overrides)
        files = [args.scenarios[0]] * 2
    elif args.sweep:
        if len(args.scenarios) != 1:
            raise _UsageError("--sweep takes exactly one scenario file")
        sweep = _sweep(args.sweep)
        field, values = sweep
        for value in values:
            sc = load_scenario(args.scenarios[0], {**overrides, field: value})
            scenarios.append(sc.model_copy(update={"name": f"{sc.name} {field}={value}"}))
            files.append(args.scenarios[0])
    else:
        for path in args.scenarios:
            scenarios.append(load_scenario(path, overrides))
            files.append(path)
    results = run_many(
        scenarios,
        files=files,
        workers=args.workers,
        progress=not args.no_progress,
        cluster=args.cluster,
    )
    console = Console()
    if len(results) == 1:
        out = Path(args.out) if args.out else default_out(scenarios[0].name)
        index = pages.write_report(results[0], out)
        if args.json:
            print(json.dumps(results[0], sort_keys=True))
        else:
            console.print(report.summary(results[0]))
            console.print(f"report: {index}")
        return 0
    out = Path(args.out) if args.out else Path("sim-out") / "comparison"
    sweep_arg = None
    if sweep is not None:
        sweep_arg = (
            sweep[0],
            [v if isinstance(v, int | float | str) else str(v) for v in sweep[1]],
        )
    index = pages.write_comparison(results, out, sweep=sweep_arg)
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        console.print(report.compare_table(results))
        console.print(f"report: {index}")
    return 0


def _simulate_seeds(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """One scenario once per seed: each run's report as a comparison's, seeds.json, the spread."""
    for option in ("seed", "sweep", "replicate"):
        if getattr(args, option) is not None:
            raise _UsageError(f"--seeds: not with --{option}")
    if len(args.scenarios) != 1:
        raise _UsageError("--seeds takes exactly one scenario file")
    scenario = load_scenario(args.scenarios[0], overrides)
    runs = [
        scenario.model_copy(update={"seed": s, "name": f"{scenario.name} seed {s}"})
        for s in args.seeds
    ]
    results = run_many(
        runs,
        files=[args.scenarios[0]] * len(runs),
        workers=args.workers,
        progress=not args.no_progress,
        cluster=args.cluster,
    )
    out = Path(args.out) if args.out else default_out(f"{scenario.name} seeds")
    index = pages.write_comparison(results, out)
    document = spread.over_seeds(results, scenario=scenario.name)
    (out / "seeds.json").write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(document, sort_keys=True))
    else:
        Console().print(report.seeds_table(document))
        print(f"report: {index}")  # print: a long path is not wrapped
        print(f"seeds: {out / 'seeds.json'}")
    return 0


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cpn plan-capacity",
        description="cheapest purchases from a menu that meet the targets (docs/simulation.md)",
    )
    p.add_argument("planning", help="planning YAML: scenario, target, menu")
    p.add_argument("--out", help="answer JSON file (default sim-out/<scenario>-capacity.json)")
    _parallel(p)
    p.add_argument("--no-progress", action="store_true")
    return p


def plan_capacity_main(argv: list[str]) -> int:
    return _run("cpn plan-capacity", _plan_parser(), argv, _plan_capacity)


def _plan_capacity(args: argparse.Namespace) -> int:
    plan, scenario, _ = load_planning(args.planning)
    console = Console(stderr=True)
    answer = plan_capacity(
        plan,
        scenario,
        workers=args.workers,
        progress=not args.no_progress,
        log=lambda line: console.print(line),
        cluster=args.cluster,
    )
    out = Path(args.out) if args.out else Path("sim-out") / f"{slug(scenario.name)}-capacity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(answer, indent=1, sort_keys=True) + "\n")
    Console().print(_answer_table(answer))
    print(f"answer: {out}")
    return 0 if answer["met"] else 1


def _answer_table(answer: dict[str, Any]) -> Table:
    verdict = "targets met" if answer["met"] else "targets NOT met with this menu"
    stopped = answer.get("stopped_early") or 0
    runs = f"{answer['evaluations']} simulations" + (
        f" ({stopped} stopped once their verdict was certain)" if stopped else ""
    )
    caption = [answer["noise"]] if answer.get("noise") else []
    caption += [
        f"round {i + 1}: {r['noise']}" for i, r in enumerate(answer["rounds"]) if r.get("noise")
    ]
    table = Table(
        title=f"{answer['scenario']}: {verdict}, {runs}",
        caption="\n".join(caption) or None,
    )
    table.add_column("purchase")
    table.add_column("added", justify="right")
    table.add_column("cost", justify="right")
    for p in answer["purchases"]:
        table.add_row(p["item"], f"{p['added']:,}", f"${p['cost_usd']:,.0f}")
    table.add_row("total", "", f"${answer['total_cost_usd']:,.0f}")
    shown = {
        "queue delay p95": ("queue_delay_p95_s", report.format_duration),
        "worst region's inference SLO": ("inference_slo", report.format_percent),
        "jobs waiting at the end": ("unplaced", lambda v: f"{v:,.0f}"),
        "cost of the simulated run": ("cost_usd", report.format_money),
    }
    for label, (name, fmt) in shown.items():
        before, after = answer["baseline"].get(name), answer["final"].get(name)
        table.add_row(f"{label}: before -> after", "", f"{_fmt(before, fmt)} -> {_fmt(after, fmt)}")
    return table


def _fmt(value: Any, fmt: Callable[[Any], str]) -> str:
    return "-" if value is None else fmt(value)
