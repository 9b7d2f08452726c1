"""`cpn plan PROBLEM.json [--time-limit S] [--workers N]`: solve a batch placement problem.

Prints the plan as JSON on stdout (docs/placement.md). A bad problem file prints one line,
`cpn: error: PATH: FIELD: message`, on stderr and exits 2, as does a missing file or bad usage.
cpn/cli.py delegates `cpn plan` here; `python -m broker.plan.cli` runs it directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from broker.plan.problem import PlanInputError, load_problem
from broker.plan.solver import collector_paused, solve


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be an integer > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cpn plan", description="Solve a batch placement problem (JSON).")
    parser.add_argument("problem", metavar="PROBLEM.json", help="the problem file")
    parser.add_argument(
        "--time-limit",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds for the whole solve (default 10)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CP-SAT search workers (default: the CPUs this process may use)",
    )
    return parser


def main(args: list[str]) -> int:
    try:
        ns = build_parser().parse_args(args)
    except _UsageError as exc:
        print(f"cpn: error: plan: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        problem = load_problem(ns.problem)
    except PlanInputError as exc:
        where = f"{ns.problem}: {exc.field}" if exc.field else ns.problem
        print(f"cpn: error: {where}: {exc.message}", file=sys.stderr)
        return 2
    with collector_paused():
        result = solve(problem, time_limit_s=ns.time_limit, workers=ns.workers)
    print(json.dumps(result.to_output(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
