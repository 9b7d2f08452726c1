"""The chaos soak, for minutes (issue 46, docs/chaos.md): jobs, gangs, workflows and inference
requests against a federation on a three-member etcd with two broker replicas and three agents
(two with a skewed clock), while agents, the leader broker and etcd members are SIGKILLed and
restarted at random. Prints the count of each fault and, for each invariant checked on the
history, how many times it was broken; exits 1 when any was.

It runs tests/broker/test_chaos_soak.py (the very soak the suite runs for 20 s) with
CPN_SOAK_S = the minutes asked, and reads its figures back:

    .venv/bin/python bench/chaos_soak.py [--minutes N] [--seed S]

Target (issue 46): 30 minutes with no invariant broken.
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

from benchkit import ROOT, log_stamped, table

TEST = "tests/broker/test_chaos_soak.py"


def soak(minutes: float, seed: int, tree: str) -> tuple[dict[str, Any], str]:
    """The soak's figures and the tail of its output (the test fails when an invariant broke
    beyond the known finding, and still writes its figures)."""
    # the run's processes' logs and files stay (other runs of pytest rotate theirs away)
    kept = Path(tempfile.mkdtemp(prefix=f"cpn-soak-{seed}-"))
    log_stamped(f"soak: logs, stamps and figures under {kept}")
    root = ROOT
    if tree == "head":
        # the committed code, not the working tree: every process the soak restarts imports the
        # code anew, and an edit under way in a shared checkout would break the restarts
        root = kept / "tree"
        root.mkdir()
        archive = subprocess.run(
            ["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    figures = kept / "figures.json"
    env = {
        **os.environ,
        "CPN_SOAK_S": str(minutes * 60),
        "CPN_SOAK_SEED": str(seed),
        "CPN_SOAK_FIGURES": str(figures),
    }
    timeout = int(minutes * 60 + 600)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider",
         "-o", f"timeout={timeout}", f"--basetemp={kept / 'pytest'}"],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    (kept / "pytest.out").write_text(done.stdout + done.stderr)
    tail = (done.stdout + done.stderr)[-4000:]
    if not figures.exists():
        raise SystemExit(f"the soak did not run to its checks:\n{tail}")
    got: dict[str, Any] = json.loads(figures.read_text())
    return got, tail if done.returncode else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="of faults (then it settles)")
    parser.add_argument("--seed", type=int, default=int(time.time()), help="the faults' dice")
    parser.add_argument(
        "--tree",
        choices=("head", "work"),
        default="head",
        help="run the committed code (a copy of HEAD, the default) or the working tree",
    )
    args = parser.parse_args()
    log_stamped(f"soak: {args.minutes:g} min of faults, seed {args.seed} ...")
    f, failed = soak(args.minutes, args.seed, args.tree)
    log_stamped("soak: done")
    print(
        f"chaos {f['chaos_s']:.0f} s, settled in {f['settle_s']:.1f} s; {f['jobs']} jobs "
        f"({', '.join(f'{n} {k}' for k, n in sorted(f['final_states'].items()))}), "
        f"{f['runs']} runs, {f['segments']} segments; seed {f['seed']}"
    )
    print(table(["fault", "count"], [[k, str(n)] for k, n in f["faults"].items()]))
    print(table(["work", "count"], [[k, str(n)] for k, n in sorted(f["work"].items())]))
    inference = f["inference"]
    print(table(["inference", "count"], [[k, str(n)] for k, n in sorted(inference.items())]))
    rows = [
        [
            v["name"],
            str(v["checked"]),
            str(v["violations"]),
            f"{v['known_finding']} (known finding)" if v["known_finding"] else "",
        ]
        for v in f["invariants"]
    ]
    print(table(["invariant", "checked", "violations", ""], rows))
    print(f"jobs that succeeded in two runs (a run ended, its report lost): {f['succeeded_twice']}")
    why = sorted(f.get("why_failed", {}).items(), key=lambda kv: -kv[1])
    print(table(["why FAILED jobs failed", "jobs"], [[k, str(n)] for k, n in why]))
    broken = [v for v in f["invariants"] if v["violations"]]
    for v in broken:
        print(f"\n{v['name']}: {v['violations']} broken, e.g.")
        for line in v["examples"]:
            print(f"  {line}")
    for job, known in f.get("evidence", {}).items():
        if job.startswith("("):  # the sites and the brokers at the end: in figures.json
            continue
        print(f"\nevidence: {job} ({known['name']}): states {' -> '.join(known['states'])}")
        for key in ("events", "stamps", "segments", "kills_near"):
            for line in known[key][-15:]:
                print(f"  {key[:-1]}: {line}")
        for other, states in known["gang"].items():
            print(f"  gang member {other}: {' -> '.join(states)}")
        for key in sorted(k for k in known if k.startswith(("report at", "assignment at"))):
            print(f"  {key}: {known[key][:200]}")
    for crash in f.get("crashed", []):
        print(
            f"\na client, fault loop or watch died (its part of the history stops there): {crash}"
        )
    if failed:
        print(f"\nthe soak's test failed:\n{failed}", file=sys.stderr)
    return 1 if broken or failed else 0


if __name__ == "__main__":
    sys.exit(main())
