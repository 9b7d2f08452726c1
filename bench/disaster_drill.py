"""The disaster drill, larger (issue 46, docs/backup.md): N jobs of each kind (finished before
the backup, running across it, accepted and finished after it, accepted after it and still
running), every etcd member of three destroyed, the registry restored from the backup while
the agents and the broker run on. Prints the recovery time and what was lost.

It runs tests/broker/test_disaster_drill.py (the very drill the suite runs, which checks the
invariants: no job ran twice, every job finished or listed as lost, the ledger equal to the
runs) with CPN_DRILL_JOBS=N, and reads its figures back:

    .venv/bin/python bench/disaster_drill.py [--jobs N] [--runs R]

Targets: lost 0 of what the agents reported; no job run twice; the ledger's segments equal
the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchkit import ROOT, log, num, table

TEST = "tests/broker/test_disaster_drill.py"


def drill(jobs: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="cpn-drill-") as scratch:
        figures = Path(scratch) / "figures.json"
        env = {**os.environ, "CPN_DRILL_JOBS": str(jobs), "CPN_DRILL_FIGURES": str(figures)}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                TEST,
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "timeout=600",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not figures.exists():
            tail = (done.stdout + done.stderr)[-3000:]
            raise SystemExit(f"the drill failed (an invariant broke or it did not run):\n{tail}")
        got: dict[str, object] = json.loads(figures.read_text())
        return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10, help="jobs of each of the four kinds")
    parser.add_argument("--runs", type=int, default=1, help="drills, one after the other")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        log(f"drill {i + 1}/{args.runs}: {4 * args.jobs} jobs ...")
        f = drill(args.jobs)
        fates = f["fates"] if isinstance(f["fates"], dict) else {}

        def sec(key: str, f: dict[str, object] = f) -> str:
            return f"{float(str(f.get(key, 'nan'))):.1f}"

        rows.append(
            [
                str(f["jobs"]),
                str(f["after_backup"]),
                sec("restore_s"),
                sec("members_s"),
                sec("settled_s"),
                sec("recovered_s"),
                ", ".join(f"{n} {k}" for k, n in sorted(fates.items())) or "-",
                str(f["lost"]),
                str(f["ran_twice"]),
                f"{f['runs']} / {f['ledger']}",
                num(float(str(f["snapshot_bytes"])) / 1e6, 2),
            ]
        )
    headers = [
        "jobs",
        "after backup",
        "cpn restore s",
        "members up s",
        "settle s",
        "recovery s",
        "settled",
        "lost",
        "ran twice",
        "runs / segments",
        "snapshot MB",
    ]
    print(table(headers, rows))
    print(
        "recovery s: from every member's loss to the restore settled (cpn restore, the "
        "members' start, the agents' reports, the leader's decisions); target: lost 0, ran "
        "twice 0, runs = segments"
    )


if __name__ == "__main__":
    main()
