"""A simulation's independent parts, run apart and merged into the results of the whole run.

A scenario's batch jobs, its inference demand and its autoscaled services do not touch each
other's state in the simulator: inference capacity is the sites' `services`, not the devices
the batch jobs hold (simulations.inference), and autoscaled services run on their own steps
(simulations.autoscaling). What they share is virtual time, the site failures (each part replays
them) and, for the two baselines that draw random numbers (`random`, `fifo-first-fit`), the
engine's random stream, which the inference routing draws from too: those scenarios are not
split. Run apart, in parallel processes, the parts give the whole run's results byte for byte
(tests/simulations/test_parts.py compares them on every shipped scenario and on random ones),
in the time of the longest part; `cpn plan-capacity` also reuses the part a candidate does not
change (a device purchase leaves the inference part as it was, a service purchase the batch
part).

    Part.batch      the batch jobs, workflows and the tenancy baseline: everything but below
    Part.inference  the inference workloads' routing and serving (results `inference`)
    Part.services   the autoscaled services (results `services`)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from simulations.scenario import PolicyKind, Scenario

__all__ = ["Part", "merge", "split", "worth_a_process"]

# a part is worth a process of its own when it takes seconds: about this many jobs, or steps
# of the inference demand (a worker's spawn and imports cost about a second)
_JOBS_WORTH = 2_000
_STEPS_WORTH = 500


class Part(enum.StrEnum):
    all = "all"
    batch = "batch"
    inference = "inference"
    services = "services"


# baselines that draw from the engine's random stream, which inference routing also draws from
_SHARED_RANDOM = frozenset({PolicyKind.random, PolicyKind.fifo_first_fit})


def split(scenario: Scenario) -> tuple[Part, ...]:
    """The parts to run the scenario as: (Part.all,) when it has one part only, or when its
    policy shares the random stream with inference routing (module docstring)."""
    parts = [Part.batch]
    if scenario.inference_workloads and scenario.policy.kind not in _SHARED_RANDOM:
        parts.append(Part.inference)
    if scenario.services:
        parts.append(Part.services)
    if len(parts) == 1 or (scenario.inference_workloads and Part.inference not in parts):
        return (Part.all,)
    return tuple(parts)


def worth_a_process(scenario: Scenario, jobs: int) -> bool:
    """Is running the scenario's inference part in a process of its own, beside its batch part
    of `jobs` jobs, worth a worker's start? (Both must take seconds.)"""
    steps = scenario.horizon / scenario.inference_step_s * len(scenario.inference_workloads)
    return jobs >= _JOBS_WORTH and steps >= _STEPS_WORTH


def merge(results: Mapping[Part, dict[str, Any]]) -> dict[str, Any]:
    """The whole run's results from its parts' (`split`'s): the batch part's, with the
    inference part's `inference` and the services part's `services`; `run` counts the
    inference part's steps among the events (its site failures are the batch part's too) and
    says what each part took (`parts_wall_s`)."""
    if Part.all in results:
        return results[Part.all]
    out = dict(results[Part.batch])
    run = dict(out["run"])
    walls = {Part.batch.value: run["wall_s"]}
    inference = results.get(Part.inference)
    if inference is not None:
        out["inference"] = inference["inference"]
        run["events"] += inference["run"]["inference_steps"]
        run["inference_steps"] = inference["run"]["inference_steps"]
        walls[Part.inference.value] = inference["run"]["wall_s"]
    services = results.get(Part.services)
    if services is not None:
        out["services"] = services["services"]
        walls[Part.services.value] = services["run"]["wall_s"]
    run["parts_wall_s"] = walls
    out["run"] = run
    return out
