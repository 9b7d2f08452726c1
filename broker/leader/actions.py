"""The leader's actor: carries out decided actions (broker.leader.decisions) as etcd transactions.

Each action is one transaction guarded on every job record's revision the decision was made
on, on the keys it needed absent or unchanged, and on the leader key (broker.state.leadership). A
lost guard means the view was behind: the action is dropped and the next pass decides anew.
If the leader key is no longer this replica's, the actor stops at once and resigns; it never
writes as a deposed leader. Only registry errors escape (the loop backs off and retries).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from broker.leader.pass_core import Action, ActionKind
from broker.state.leadership import Leadership
from broker.state.metrics import BrokerMetrics
from broker.state.store import writes
from sites.model import keys
from sites.model.assignments import Assignment, Report
from sites.registry.client import Guard, Registry

__all__ = ["Actor", "Outcome"]

log = logging.getLogger(__name__)

# actions that move a job between lifecycle states (cpn_broker_job_transitions_total)
_TRANSITIONS = frozenset(
    {
        ActionKind.advance,
        ActionKind.requeue,
        ActionKind.migrate,
        ActionKind.fail,
        ActionKind.preempt,
    }
)


@dataclass
class Outcome:
    done: list[Action] = field(default_factory=list)
    stale: list[Action] = field(default_factory=list)
    deposed: bool = False


class Actor:
    def __init__(
        self,
        *,
        registry: Registry,
        leadership: Leadership,
        metrics: BrokerMetrics,
        late_report: Callable[[Report], Awaitable[object]] | None = None,
    ) -> None:
        self.registry = registry
        self.leadership = leadership
        self.metrics = metrics
        # a drop_report's late end, billed before the report goes (Action.late)
        self.late_report = late_report
        # assignments committed that the view has not mirrored yet: capacity they hold
        self.written: dict[str, Assignment] = {}

    def forget_mirrored(self, attempts: Mapping[str, int]) -> None:
        """Drop written assignments once the view has the job (an unfinished one: `attempts`)
        at or past their attempt, or no longer has it (it finished)."""
        for key, a in list(self.written.items()):
            seen = attempts.get(a.job)
            if seen is None or seen >= a.attempt:
                del self.written[key]

    async def carry_out(self, actions: Iterable[Action]) -> Outcome:
        out = Outcome()
        for action in actions:
            if not self.leadership.is_leader:
                out.deposed = True
                break
            if action.late is not None and self.late_report is not None:
                await self.late_report(action.late)
            guards = [self.leadership.guard(), *action.guards]
            puts: dict[str, bytes] = {}
            deletes = list(action.deletes)
            for write in action.jobs:
                key = keys.job(write.record.id)
                guards.append(Guard(key, mod_revision=write.revision))
                guards.extend(write.guards)
                own, gone = writes(write.record)
                puts.update(own)
                puts.update(write.puts)
                deletes.extend(gone)
                deletes.extend(write.deletes)
            ok = await self.registry.commit(guards=guards, puts=puts, deletes=deletes)
            self.metrics.actions.labels(action.kind.value, "done" if ok else "stale").inc()
            if ok:
                out.done.append(action)
                self._account(action)
                continue
            if not await self.leadership.still_leader():
                log.warning("leader key is no longer ours: stopping, resigning")
                self.leadership.resign()
                out.deposed = True
                break
            out.stale.append(action)
            log.debug("action %s on %s: the view was behind", action.kind, action.job_ids)
        return out

    def _account(self, action: Action) -> None:
        for write in action.jobs:
            for key in write.deletes:
                self.written.pop(key, None)  # a run this leader wrote and took back
        for a in action.assignments:
            self.written[keys.assignment(a.site, a.job)] = a
        if action.kind is ActionKind.place:
            self.metrics.placements.inc(len(action.jobs))
        elif action.kind is ActionKind.migrate:
            self.metrics.migrations.inc(len(action.jobs))
        elif action.kind is ActionKind.preempt:
            self.metrics.placements.inc(len(action.assignments))
            self.metrics.preemptions.inc(len(action.jobs) - len(action.assignments))
        if action.kind in _TRANSITIONS:
            for write in action.jobs:
                self.metrics.transitions.labels(write.record.state.value).inc()
