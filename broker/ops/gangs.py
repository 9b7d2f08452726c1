"""Gangs: members that run together or not at all. Pure rules over job records.

A gang is named per tenant ('<tenant>/<gang>'); its first member (oldest) defines it: its
gang.size and its shape (gpu, cpu, mem_gb, duration_hours). broker.ops.operations applies the
same rules at submit (against the gang's record), broker.leader.decisions when it places.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.model.jobs import JobRecord, gang_of
from broker.state.view import View

__all__ = ["SHAPE", "GangProblem", "gang_key", "gang_problem", "gangs", "shape"]


def gang_key(record: JobRecord) -> str | None:
    """A gang is named per tenant: '<tenant>/<gang>' (broker.model.jobs.gang_of)."""
    return gang_of(record.spec)


def gangs(view: View) -> dict[str, list[tuple[JobRecord, int]]]:
    """Gang key -> its members that are not finished, oldest first."""
    out: dict[str, list[tuple[JobRecord, int]]] = {}
    for record, rev in view.jobs.values():
        key = gang_key(record)
        if key is not None and not record.state.terminal:
            out.setdefault(key, []).append((record, rev))
    for members in out.values():
        members.sort(key=lambda rr: (rr[0].created_at, rr[0].id))
    return out


@dataclass(frozen=True, slots=True)
class GangProblem:
    message: str
    job: str | None  # the one member at fault; None: every member


def gang_problem(name: str, members: Sequence[JobRecord]) -> GangProblem | None:
    """Why these unfinished members (oldest first) can never form their gang, if they cannot."""
    if not members:
        return None
    first = members[0].spec
    size = first.gang.size if first.gang else 0
    for record in members[1:]:
        gang = record.spec.gang
        if gang is not None and gang.size != size:
            # the gang's first member defines it, as its record does at submit
            return GangProblem(
                f"gang {name} has gang.size {size} (its first member {members[0].id}); "
                f"member {record.id} says {gang.size}",
                record.id,
            )
        if shape(record) != shape(members[0]):
            return GangProblem(
                f"gang {name}: member {record.id} asks for other resources than {members[0].id} "
                "(gpu, cpu, mem_gb and duration_hours must agree)",
                record.id,
            )
    if len(members) > size:
        extra = members[size]
        return GangProblem(
            f"gang {name} has gang.size {size}; member {extra.id} is one too many", extra.id
        )
    return None


SHAPE = ("gpu", "cpu", "mem_gb", "duration_hours")  # the JobSpec fields members share


def shape(record: JobRecord) -> tuple[object, ...]:
    return tuple(getattr(record.spec, name) for name in SHAPE)
