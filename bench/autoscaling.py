"""Autoscaling on one daily trace across regions, simulated (issue 15, first benchmark).

Prints figures; it is not a timed test. One day of configs/scenarios/autoscaling.yaml: a chat
service (the stand-in qwen2.5-7b service time, 8 slots per replica, p95 TTFT SLO of 500 ms
with RTT in every client region), demand in 12 client regions peaking at 20:00 local time, so
the peak follows the sun. The same Poisson draws (seed) run under three policies in
simulations.autoscaling, with the gateway's routing policy and the federation's RTT:

    cpn       broker.model.autoscaler.decide: replicas per region near the demand, SLO and
    saturation
              aware, the spec's delays (up 60 s, down 600 s)
    skyserve  broker.model.autoscaler.skyserve_decide: SkyServe's RequestRateAutoscaler, one region,
              ceil(QPS over 60 s / target), a decision every 20 s, up after 300 s, down after
              1,200 s (sky/serve/autoscalers.py)
    static    max_replicas all day, spread over the regions by their peak demand

and cpn once more per value of target_qps_per_replica in --sweep, which answers "how many
replica-hours does this daily cycle need for a 99 % SLO in every region?" and shows the
trade-off. SLO attainment: the share of a region's requests whose TTFT (RTT included) is within
its p95 target; dropped requests count as misses.

    .venv/bin/python bench/autoscaling.py                      # ~8 minutes on 2 cores
    .venv/bin/python bench/autoscaling.py --horizon 6h --sweep 36,44
    .venv/bin/python bench/autoscaling.py --workers 1

Targets (issue 15): SLO attainment at least the static fleet's with at most 0.6x its
replica-hours; better SLO than the SkyServe-like baseline at no more replica-hours.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchkit import share  # noqa: E402

from simulations.autoscaling import ServiceSim  # noqa: E402
from simulations.scenario import build_federation, load_scenario  # noqa: E402
from simulations.service_demand import ScalerKind  # noqa: E402
from sites.model.durations import parse_duration_s  # noqa: E402

SCENARIO = REPO / "configs" / "scenarios" / "autoscaling.yaml"
STATIC_RATIO = 0.6
GOAL = 0.99
STEP = "20 s step"  # the scenario's step_s: each step's p95 per client region
TARGET_FIELD = "services.0.spec.scaling.target_qps_per_replica"


def one(path: str, horizon: float | None, kind: str, target: float | None) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if horizon is not None:
        overrides["horizon"] = horizon
    if target is not None:
        overrides[TARGET_FIELD] = target
    scenario = load_scenario(path, overrides)
    fed = build_federation(scenario)
    started = time.perf_counter()
    res = ServiceSim(scenario, fed, scenario.services[0], ScalerKind(kind)).run()
    res["wall_s"] = time.perf_counter() - started
    res["target_qps"] = scenario.services[0].spec.scaling.target_qps_per_replica
    return res


def ms(x: float | None) -> str:
    return "none" if x is None else f"{x:.0f} ms"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def cheapest(rows: list[dict[str, Any]], static: dict[str, Any], what: str, extra: str) -> str:
    """The line naming the cheapest of `rows` (sweep results that meet `what`), against the
    static fleet's replica-hours and the 0.6x target."""
    best = min(rows, key=lambda r: r["replica_hours"])
    share = best["replica_hours"] / static["replica_hours"]
    return (
        f"  cheapest with {what}: target {best['target_qps']:g}, "
        f"{best['replica_hours']:.1f} replica-hours = {share:.2f}x static, {extra}"
        f"target <= {STATIC_RATIO}x: {verdict(share <= STATIC_RATIO)}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenario", default=str(SCENARIO))
    p.add_argument("--horizon", help="override the scenario's horizon (e.g. 6h)")
    p.add_argument(
        "--sweep",
        default="33,34.5,36,44,48",
        help="cpn's target_qps_per_replica values besides the scenario's (comma-separated)",
    )
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    horizon = parse_duration_s(args.horizon) if args.horizon else None
    values = [float(v) for v in args.sweep.split(",") if v.strip()]
    jobs: list[tuple[str, float | None]] = [("cpn", None), ("skyserve", None), ("static", None)]
    jobs += [("cpn", v) for v in values]
    print(f"{len(jobs)} simulated days of {Path(args.scenario).name}, {args.workers} workers")
    started = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        futures = [pool.submit(one, args.scenario, horizon, kind, t) for kind, t in jobs]
        results = []
        for (kind, t), future in zip(jobs, futures, strict=True):
            res = future.result()
            results.append(res)
            label = kind if t is None else f"{kind} target {t:g}"
            print(
                f"  {label}: {res['replica_hours']:.1f} replica-hours, "
                f"SLO {share(res['slo_attainment'])}, {res['wall_s']:.0f} s",
                file=sys.stderr,
            )
    cpn, sky, static = results[0], results[1], results[2]
    sweep = [cpn, *results[3:]]
    print(f"done in {time.perf_counter() - started:.0f} s\n")

    print(f"service time {cpn['service']}: target {cpn['target_qps']:g} req/s per replica")
    print(f"SkyServe-like baseline in region {sky['baseline_region']}\n")
    head = f"{'client region':14} {'SLO':>7}" + "".join(
        f" {name:>22}" for name in ("cpn", "skyserve", "static")
    )
    print(head)
    for client in sorted(cpn["regions"]):
        cells = []
        for r in (cpn, sky, static):
            region = r["regions"][client]
            cells.append(f"{share(region['slo_attainment'])} p95 {ms(region['p95_ms'])}")
        slo = cpn["regions"][client]["slo_ms"]
        print(f"{client:14} {ms(slo):>7}" + "".join(f" {c:>22}" for c in cells))
    print()
    for name, r in (("cpn", cpn), ("skyserve", sky), ("static", static)):
        met = sum(
            1
            for v in r["regions"].values()
            if v["p95_ms"] is not None and v["p95_ms"] <= v["slo_ms"]
        )
        print(
            f"{name:9} replica-hours {r['replica_hours']:8.1f}  peak {r['peak_replicas']:3d}  "
            f"SLO {share(r['slo_attainment'])}  worst {share(r['slo_worst'])} "
            f"({r['slo_worst_region']})"
            f"  p95 within the SLO in {met} of {len(r['regions'])} regions, "
            f"in {share(r['steps_met'], 3)} of (region, step) pairs"
        )
    print()

    ratio = cpn["replica_hours"] / static["replica_hours"]
    ok_static = (
        cpn["slo_attainment"] >= static["slo_attainment"]
        and cpn["slo_worst"] >= static["slo_worst"]
        and ratio <= STATIC_RATIO
    )
    print("Targets at the scenario's settings:")
    print(
        f"  vs static:   SLO {share(cpn['slo_attainment'])} (worst {share(cpn['slo_worst'])}) vs "
        f"{share(static['slo_attainment'])} (worst {share(static['slo_worst'])}), "
        f"replica-hours {ratio:.2f}x (target: SLO at least static's, <= {STATIC_RATIO}x): "
        f"{verdict(ok_static)}"
    )
    ok_steps = cpn["steps_met"] >= static["steps_met"] and ratio <= STATIC_RATIO
    print(
        f"  vs static, the p95 SLO as compliance (its share of (region, {STEP}) pairs met): "
        f"{share(cpn['steps_met'], 3)} vs {share(static['steps_met'], 3)}, {ratio:.2f}x: "
        f"{verdict(ok_steps)}"
    )
    ok_sky = (
        cpn["slo_attainment"] > sky["slo_attainment"]
        and cpn["slo_worst"] > sky["slo_worst"]
        and cpn["replica_hours"] <= sky["replica_hours"]
    )
    print(
        f"  vs skyserve: SLO {share(cpn['slo_attainment'])} (worst {share(cpn['slo_worst'])}) vs "
        f"{share(sky['slo_attainment'])} (worst {share(sky['slo_worst'])}), replica-hours "
        f"{cpn['replica_hours']:.1f} vs {sky['replica_hours']:.1f} (target: better SLO, no more "
        f"replica-hours): {verdict(ok_sky)}"
    )
    print()

    print(f"cpn over target_qps_per_replica ({TARGET_FIELD}):")
    print(
        f"  {'target':>7} {'replica-hours':>14} {'x static':>9} {'SLO':>8} {'worst region':>22} "
        f"{'p95 met':>8}"
    )
    for r in sorted(sweep, key=lambda r: r["target_qps"]):
        print(
            f"  {r['target_qps']:7g} {r['replica_hours']:14.1f} "
            f"{r['replica_hours'] / static['replica_hours']:9.2f} "
            f"{share(r['slo_attainment'], 3):>8} "
            f"{share(r['slo_worst'], 3) + ' ' + str(r['slo_worst_region']):>22} "
            f"{share(r['steps_met'], 3):>8}"
        )
    at_least_static = [
        r
        for r in sweep
        if r["slo_attainment"] >= static["slo_attainment"] and r["slo_worst"] >= static["slo_worst"]
    ]
    if at_least_static:
        print(cheapest(at_least_static, static, "SLO at least static's", ""))
    else:
        near = [r for r in sweep if r["replica_hours"] <= STATIC_RATIO * static["replica_hours"]]
        print(
            f"  no setting of the sweep reaches static's SLO attainment "
            f"({share(static['slo_attainment'], 3)}, worst {share(static['slo_worst'], 3)})"
        )
        if near:
            best = max(near, key=lambda r: (r["slo_worst"], r["slo_attainment"]))
            print(
                f"  closest within {STATIC_RATIO}x: target {best['target_qps']:g}, "
                f"{best['replica_hours'] / static['replica_hours']:.2f}x, SLO "
                f"{share(best['slo_attainment'], 3)} (worst {share(best['slo_worst'], 3)}): "
                f"{100 * (static['slo_attainment'] - best['slo_attainment']):.4f} points "
                f"({100 * (static['slo_worst'] - best['slo_worst']):.4f} worst) short"
            )
    compliant = [r for r in sweep if r["steps_met"] >= static["steps_met"]]
    if compliant:
        what = f"the p95 SLO met as often as static's ({share(static['steps_met'], 3)} of pairs)"
        best = min(compliant, key=lambda r: r["replica_hours"])
        extra = f"per-request SLO {share(best['slo_attainment'], 3)}, "
        print(cheapest(compliant, static, what, extra))
    within = [r for r in sweep if r["replica_hours"] <= sky["replica_hours"]]
    if within:
        best = max(within, key=lambda r: (r["slo_worst"], r["slo_attainment"]))
        better = (
            best["slo_attainment"] > sky["slo_attainment"] and best["slo_worst"] > sky["slo_worst"]
        )
        print(
            f"  best SLO within skyserve's {sky['replica_hours']:.1f} replica-hours: target "
            f"{best['target_qps']:g}, {best['replica_hours']:.1f} h, SLO "
            f"{share(best['slo_attainment'])} (worst {share(best['slo_worst'])}) vs "
            f"{share(sky['slo_attainment'])} (worst {share(sky['slo_worst'])}): {verdict(better)}"
        )
    else:
        print("  no setting of the sweep stays within skyserve's replica-hours")
    meeting = [r for r in sweep if r["slo_worst"] is not None and r["slo_worst"] >= GOAL]
    if meeting:
        best = min(meeting, key=lambda r: r["replica_hours"])
        print(
            f"  {GOAL:.0%} SLO in every region: {best['replica_hours']:.1f} replica-hours a day "
            f"(target {best['target_qps']:g} req/s per replica, worst {share(best['slo_worst'])} "
            f"in {best['slo_worst_region']})"
        )
    else:
        print(f"  no setting of the sweep gives {GOAL:.0%} in every region")
    return 0


if __name__ == "__main__":
    sys.exit(main())
