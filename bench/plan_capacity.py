"""`cpn plan-capacity` on plan-demo: the search as the planner runs it, against the plain search.

Prints figures; it is not a timed test (issue 43). Two runs of the same planning file
(configs/scenarios/plan-demo.yaml unless --planning):

- **planner**: `python -m cpn plan-capacity PLANNING --out <tmp>/answer.json --no-progress`
  as a subprocess, wall time measured around it (interpreter start, imports, the pool's spawn,
  the search, the answer written). Each candidate runs as its parts (simulations.parts), the
  parts a purchase does not change are reused, and runs stop once their verdict is certain and
  cannot be chosen (simulations.capacity.Bound).
- **plain** (unless --skip-plain): `simulations.capacity.plan_capacity(plan, scenario,
  plain=True)` in this process after `load_planning`, timed around both: every candidate
  simulated whole to the horizon, no part reused, nothing stopped early; the same pool of
  workers for the whole search (the search before issue 43 had the same rounds and
  candidates).

The table has each search's wall seconds, its own `wall_s`, the simulations it ran
(`evaluations`), how many stopped early, the purchases, their cost and whether the targets
were met, then whether both found the same purchases. For the record it also prints the
search before today's work on plan-demo, measured on this 2-core machine before the change.

    .venv/bin/python bench/plan_capacity.py                  # ~45 s, then ~3.5 min plain
    .venv/bin/python bench/plan_capacity.py --skip-plain     # the planner's run only
    .venv/bin/python bench/plan_capacity.py --planning my-plan.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchkit import log, table  # noqa: E402

from simulations.capacity import load_planning, plan_capacity  # noqa: E402

PLAN_DEMO = REPO / "configs" / "scenarios" / "plan-demo.yaml"
TARGET_S = 90.0
TARGET = "target: under 90 s on 2 cores, the same purchases as the plain greedy search"
# plan-demo before issue 43's search (commit 2a4679d), this machine, 2026-12-07: a fresh pool
# of whole-run simulations per round, none stopped early
RECORDED_S = 206.0  # 3 min 26 s
RECORDED_EVALUATIONS = 13
RECORDED_PURCHASES = [("chongqing: qwen-7b concurrency", 32), ("qingyang: H20", 256)]  # not met


def planner(planning: Path, out: Path) -> tuple[float, dict[str, Any]]:
    """The planner's run as a user starts it; its progress lines go to stderr as they come."""
    argv = [sys.executable, "-m", "cpn", "plan-capacity", str(planning)]
    argv += ["--out", str(out), "--no-progress"]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1) or not out.exists():  # 1: the targets were not met
        raise SystemExit(f"cpn plan-capacity exited {done.returncode}:\n{done.stdout[-3000:]}")
    answer: dict[str, Any] = json.loads(out.read_text())
    return wall, answer


def plain(planning: Path) -> tuple[float, dict[str, Any]]:
    """The same search with every candidate simulated whole (plan_capacity's `plain`)."""
    started = time.perf_counter()
    plan, scenario, _ = load_planning(planning)
    answer = plan_capacity(plan, scenario, plain=True, log=lambda line: log(f"  plain: {line}"))
    return time.perf_counter() - started, answer


def bought(answer: dict[str, Any]) -> list[tuple[str, int]]:
    return sorted((p["item"], int(p["added"])) for p in answer["purchases"])


def describe(purchases: list[tuple[str, int]]) -> str:
    return ", ".join(f"{item} +{added:,}" for item, added in purchases) or "nothing"


def recorded_cost(planning: Path) -> float | None:
    """What the recorded purchases cost at the planning file's prices (None: not on its menu)."""
    plan, _, _ = load_planning(planning)
    prices = {item.describe(): (item.step, item.step_usd) for item in plan.menu}
    total = 0.0
    for what, added in RECORDED_PURCHASES:
        if what not in prices:
            return None
        step, usd = prices[what]
        total += added / step * usd
    return total


def row(name: str, wall: float, answer: dict[str, Any]) -> list[str]:
    return [
        name,
        f"{wall:.1f}",
        f"{answer['wall_s']:.1f}",
        str(answer["evaluations"]),
        str(answer["stopped_early"]),
        describe(bought(answer)),
        f"${answer['total_cost_usd']:,.0f}",
        "yes" if answer["met"] else "no",
    ]


def rounds(answer: dict[str, Any]) -> None:
    """The planner's rounds: what each bought, what it beat, the runs it stopped early."""
    for i, r in enumerate(answer["rounds"], 1):
        extra = f", runner-up {r['runner_up']}" if r.get("runner_up") else ""
        print(f"  round {i}: {r['bought']}, shortfall {r['shortfall']:.3f}{extra}")
        for line in r.get("stopped_early", []):
            print(f"    stopped early: {line}")
        if r.get("noise"):
            print(f"    {r['noise']}")
    if answer.get("noise"):
        print(f"  noise: {answer['noise']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planning", type=Path, default=PLAN_DEMO, help="planning YAML")
    ap.add_argument("--skip-plain", action="store_true", help="the planner's run only")
    args = ap.parse_args()
    planning = args.planning.resolve()
    log(f"{planning.name} on {os.cpu_count()} CPUs: the planner (cpn plan-capacity) ...")
    with tempfile.TemporaryDirectory(prefix="cpn-bench-plan-") as tmp:
        fast_wall, fast = planner(planning, Path(tmp) / "answer.json")
    headers = ["search", "wall s", "its wall_s", "simulations", "stopped early", "purchases"]
    headers += ["total cost", "met"]
    rows = [row("planner (parts, reuse, early stops)", fast_wall, fast)]
    other: list[tuple[str, int]] | None = None
    if not args.skip_plain:
        log("the plain search (every candidate whole, to the horizon) ...")
        plain_wall, slow = plain(planning)
        rows.append(row("plain (whole runs, in-process)", plain_wall, slow))
        other = bought(slow)
    print(table(headers, rows))
    print(f"planner's rounds ({fast['scenario']}, seeds {fast['seeds']}):")
    rounds(fast)
    if planning == PLAN_DEMO:
        cost = recorded_cost(planning)
        print(
            f"recorded before issue 43 (this machine, 2026-12-07): {RECORDED_S:.0f} s "
            f"(3 min 26 s), {RECORDED_EVALUATIONS} simulations, {describe(RECORDED_PURCHASES)}"
            + (f", ${cost:,.0f}" if cost is not None else "")
            + ", targets not met"
        )
        if other is None:
            other = RECORDED_PURCHASES
    print(TARGET)
    verdict = "met" if fast_wall < TARGET_S else "NOT met"
    print(f"  planner: {fast_wall:.1f} s -> {verdict}")
    if other is not None:
        same = bought(fast) == sorted(other)
        against = "the plain search" if not args.skip_plain else "the recorded search"
        print(f"same purchases: {'yes' if same else 'no'} (against {against})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
