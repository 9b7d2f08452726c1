"""The chaos soak's history and the invariants checked on it (docs/chaos.md): pure functions of
what was recorded (job records as etcd's watch saw them, the runs as the jobs themselves
stamped them, the ledger's segments, the pending samples, the inference calls, the faults),
so each check is a value and a list of what broke it."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass
class Run:
    """One attempt as the job saw it: `start` and `end` are the host's real time (the job's
    own `date`, never a skewed agent's clock); `end` None when it was killed without a word."""

    job: str
    attempt: int
    site: str
    start: float
    end: float | None = None
    outcome: str | None = None  # the exit status, "term" when it was stopped


@dataclass
class Kill:
    """A SIGKILL the soak sent: what (`agent:<site>`, `broker:<name>`, `etcd:<i>`) and when."""

    target: str
    at: float
    back_at: float | None = None


@dataclass
class History:
    # job id -> every job record state and (attempt, fence) the watch saw, in revision order
    states: dict[str, list[str]] = field(default_factory=dict)
    fences: dict[str, dict[int, set[int]]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # job id -> its name
    gaps: int = 0  # the watch lost events (a compacted revision): its checks are not whole
    runs: dict[tuple[str, int], Run] = field(default_factory=dict)
    # (job, attempt) of every run an agent's executor logged as started (its sandbox up, the
    # command maybe not yet at its first line when it was stopped)
    launched: set[tuple[str, int]] = field(default_factory=set)
    # runs whose agent died before its `running` report was written: the broker never knew
    # they ran (their record has no `running` event for the attempt)
    unreported: set[tuple[str, int]] = field(default_factory=set)
    # (job, attempt) -> (site, start, end, seconds) of every usage segment of a run
    # (job, attempt) -> (site, start, end, seconds billed, whose clock: "site" or "broker")
    segments: dict[tuple[str, int], tuple[str, float, float, float, str]] = field(
        default_factory=dict
    )
    kills: list[Kill] = field(default_factory=list)
    skew_s: dict[str, float] = field(default_factory=dict)  # site -> its agent's clock skew
    waited_too_long: list[str] = field(default_factory=list)  # "job: why" (the sampler's)
    inference: Counter[str] = field(default_factory=Counter)  # requests, first_try_errors, ...
    inference_errors: list[float] = field(default_factory=list)  # when each first try failed


def record_job(history: History, job: str, doc: dict[str, Any]) -> None:
    """One put of job `job`'s record, in revision order."""
    history.names.setdefault(job, str(doc.get("spec", {}).get("name", "")))
    seen = history.states.setdefault(job, [])
    if not seen or seen[-1] != doc["state"]:
        seen.append(str(doc["state"]))
    attempt, fence = int(doc.get("attempt", 0)), int(doc.get("fence", 0))
    if attempt and fence:
        history.fences.setdefault(job, {}).setdefault(attempt, set()).add(fence)


LAUNCHED = re.compile(r"job (\S+) attempt (\d+) started: pid")


def record_launches(history: History, agent_log: str) -> None:
    """The runs an agent's log says its executor started."""
    for job, attempt in LAUNCHED.findall(agent_log):
        history.launched.add((job, int(attempt)))


def record_marker(history: History, line: str) -> None:
    """A line a job stamped: `start JOB ATTEMPT SITE T` or `end JOB ATTEMPT OUTCOME T`."""
    parts = line.split()
    if len(parts) != 5:
        return
    kind, job, attempt, what, at = parts
    key = (job, int(attempt))
    if kind == "start":
        history.runs[key] = Run(job=job, attempt=int(attempt), site=what, start=float(at))
    elif kind == "end" and key in history.runs:
        history.runs[key].end = float(at)
        history.runs[key].outcome = what


KILL_RACE_S = 1.0  # a run's stamp can follow its agent's SIGKILL by this much (fork, exec)


def run_end(history: History, run: Run) -> float | None:
    """When a run ended: its own stamp, else the SIGKILL of the agent instance that launched
    it (its runs die with it: the first kill of its site's agent whose restart came after the
    run began, the kill no more than KILL_RACE_S before its start stamp), else None."""
    if run.end is not None:
        return run.end
    kills = [
        k.at
        for k in history.kills
        if k.target == f"agent:{run.site}"
        and k.at > run.start - KILL_RACE_S
        and (k.back_at is None or k.back_at > run.start)
    ]
    return max(min(kills), run.start) if kills else None


@dataclass
class Verdict:
    name: str
    checked: int
    broken: list[str]

    @property
    def violations(self) -> int:
        return len(self.broken)


def live_runs(history: History) -> set[tuple[str, int]]:
    """The runs still going at the end: no end stamp, no kill of their agent after they began,
    of a job whose last state is RUNNING."""
    return {
        key
        for key, run in history.runs.items()
        if history.states.get(run.job, ["?"])[-1] == "RUNNING" and run_end(history, run) is None
    }


def terminal_once(history: History) -> Verdict:
    """Every accepted job ends in exactly one terminal state, or is still RUNNING with exactly
    one run going (as its stamps say)."""
    broken = []
    live = Counter(job for job, _ in live_runs(history))
    for job, states in history.states.items():
        entered = sum(1 for s in states if s in TERMINAL)
        pairs = zip(states, states[1:], strict=False)
        left = any(a in TERMINAL and b not in TERMINAL for a, b in pairs)
        if entered > 1 or left:
            broken.append(f"{job}: states {' -> '.join(states)}")
        elif states[-1] == "RUNNING" and live[job] != 1:
            broken.append(f"{job}: RUNNING at the end with {live[job]} runs going")
        elif states[-1] not in TERMINAL and states[-1] != "RUNNING":
            broken.append(f"{job}: still {states[-1]} at the end ({' -> '.join(states)})")
    return Verdict("one terminal state (or running once)", len(history.states), broken)


def one_placement_per_attempt(history: History) -> Verdict:
    """Each attempt of a job was placed under one fence: never two runs called the same."""
    broken = [
        f"{job}: attempt {attempt} under fences {sorted(fences)}"
        for job, attempts in history.fences.items()
        for attempt, fences in attempts.items()
        if len(fences) > 1
    ]
    return Verdict("one fence per attempt", sum(map(len, history.fences.values())), broken)


def _overlaps(spans: list[tuple[int, float, float]], slack_s: float) -> list[str]:
    out = []
    spans = sorted(spans, key=lambda s: s[1])
    for (a1, _, e1), (a2, s2, _) in zip(spans, spans[1:], strict=False):
        if s2 < e1 - slack_s:
            out.append(f"attempt {a2} started {e1 - s2:.2f} s before attempt {a1} ended")
    return out


def no_overlap_runs(history: History) -> Verdict:
    """No two attempts of a job ran at the same time, as the job itself saw them (a run with
    neither an end stamp nor a kill of its agent after it counts as running to the end)."""
    by_job: dict[str, list[tuple[int, float, float]]] = {}
    for run in history.runs.values():
        end = run_end(history, run)
        by_job.setdefault(run.job, []).append((run.attempt, run.start, end or float("inf")))
    broken = [f"{job}: {why}" for job, spans in by_job.items() for why in _overlaps(spans, 0.0)]
    return Verdict("no overlapping attempts (the jobs' stamps)", len(history.runs), broken)


def no_overlap_reports(history: History, slack_s: float = 0.05) -> Verdict:
    """No two attempts of a job overlap in what the agents reported (the ledger's segments:
    the reported start, the reported end or the lost site's last sign of life), each site's
    times taken back by its known clock skew."""
    by_job: dict[str, list[tuple[int, float, float]]] = {}
    for (job, attempt), (site, start, end, _, clock) in history.segments.items():
        # a segment on the broker's clock (metering.ledger.span) is not off by the site's skew
        skew = history.skew_s.get(site, 0.0) if clock == "site" else 0.0
        by_job.setdefault(job, []).append((attempt, start - skew, end - skew))
    broken = [f"{job}: {why}" for job, spans in by_job.items() for why in _overlaps(spans, slack_s)]
    return Verdict("no overlapping attempts (agents' reports)", len(history.segments), broken)


def ledger_equals_runs(history: History) -> Verdict:
    """The ledger holds one segment for each run whose command ran (its stamp) and ended, and
    none for a run no agent launched (a run still going is billed when it ends)."""
    live = live_runs(history)
    ran = set(history.runs) - live
    launched = ran | history.launched
    billed = set(history.segments)
    broken = [f"{j} attempt {a}: ran, not billed" for j, a in sorted(ran - billed)]
    # a segment of no length bills nothing: the next agent's report of a run recorded as it was
    # launched, whose agent died in that instant (it may never have started)
    nothing = {key for key, seg in history.segments.items() if seg[3] <= 0.0}
    broken += [
        f"{j} attempt {a}: billed, never ran" for j, a in sorted(billed - launched - live - nothing)
    ]
    broken += [f"{j} attempt {a}: billed while it runs" for j, a in sorted(billed & live)]
    return Verdict("ledger = runs", len(ran | billed), broken)


# an agent killed this long after its run ended may not have taken the end in yet (a busy
# host lets an agent fall seconds behind its children's exits)
AGENT_LAG_S = 10.0


def _lost_with_its_agent(history: History, run: Run, end: float) -> bool:
    """Whether the run's agent was SIGKILLed while it ran, or before it could have taken the
    run's end in: then the end went with the agent, and the ledger bills the run to the
    agent's last sign of life (docs/metering.md): what is known to have run, less than it
    ran, never more."""
    target = f"agent:{run.site}"
    return any(k.target == target and run.start <= k.at <= end + AGENT_LAG_S for k in history.kills)


def billed_time(history: History, tolerance_s: float) -> Verdict:
    """A finished run's segment is as long as the run was, within `tolerance_s`; shorter only
    when its agent died with its end (`_lost_with_its_agent`)."""
    broken = []
    checked = 0
    for key, run in history.runs.items():
        end = run.end
        if end is None or key not in history.segments:
            continue
        checked += 1
        seconds = history.segments[key][3]
        if seconds < end - run.start and _lost_with_its_agent(history, run, end):
            continue
        if abs(seconds - (end - run.start)) > tolerance_s:
            broken.append(
                f"{key[0]} attempt {key[1]} at {run.site}: billed {seconds:.2f} s, "
                f"ran {end - run.start:.2f} s"
            )
    return Verdict(f"billed time = run time (+-{tolerance_s:g} s)", checked, broken)


def no_idle_wait(history: History, checked: int) -> Verdict:
    """No job waited PENDING past the pass bound while a site that fits it had it free."""
    return Verdict("no pending job beside free capacity", checked, list(history.waited_too_long))


def inference_retried(history: History, grace_s: float) -> Verdict:
    """Every inference request was answered within its retries, and a first try failed only
    while something was down: between a kill and `grace_s` after its restart (the errors are
    bounded by the faults, not spread over the run)."""
    counts = history.inference
    broken = [f"{n} request(s) failed every retry" for n in [counts["gave_up"]] if n]
    windows = [(k.at, (k.back_at or float("inf")) + grace_s) for k in history.kills]
    for at in history.inference_errors:
        if not any(start <= at <= end for start, end in windows):
            broken.append(f"a first try failed at {at:.2f}, no fault within {grace_s:g} s")
    return Verdict("inference answered (retried)", counts["requests"], broken)


def fault_counts(history: History) -> Counter[str]:
    kinds: Counter[str] = Counter(k.target.split(":")[0] for k in history.kills)
    return Counter(
        {
            "agent SIGKILLed + restarted": kinds["agent"],
            "leader broker SIGKILLed + restarted": kinds["broker"],
            "etcd member SIGKILLed + restarted": kinds["etcd"],
            "agents with a skewed clock": len(history.skew_s),
        }
    )
