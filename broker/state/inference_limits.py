"""Inference limits and budgets held by every broker replica together (`InferenceLimits`).

A tenant's `inference` policy (broker.model.tenants.InferencePolicy) and a token's own `limits`
(broker.state.auth.TokenRecord) set requests and tokens per minute and a monthly budget. Each
broker replica counts what it admitted and charged, and publishes it at
/cpn/v1/inference-limits/<tenant>/<writer> (sites.model.keys.inference_limit, a `LimitRecord`):

    requests and tokens per second of the last WINDOW_S seconds (`buckets`: [second, requests,
    tokens], whole unix seconds), and the calendar month's (UTC) tokens and USD, for the tenant
    and for each of its tokens that has limits of its own (`by_token`).

Every replica follows the prefix (a PrefixMirror, decoded on arrival) and keeps, per tenant and
per limited token, the sum of the other replicas' published seconds (`Window`, a ring of
WINDOW_S one-second slots with running totals) beside its own counts, which it holds itself (the
published copy of its own key is only read back when it starts, so a restarted replica with the
same writer id keeps its month). `admit` then answers from memory in O(1) amortized: no I/O.

    refused when  requests in the window >= requests_per_minute       (429, Retry-After)
                  tokens in the window >= tokens_per_minute           (429, Retry-After)
                  the month's tokens or USD >= the budget             (429, x-should-retry: false)

A request is counted when admitted, its tokens when `charge` is called after the response (a
running stream is never cut), so a request is admitted while the window is below the limit.
The window covers the current second and the WINDOW_S - 1 whole seconds before it (60.x s),
so any 60 s span holds at most the limit plus the overshoot below.

Accuracy. What R replicas admit in any 60 s exceeds a limit by at most (a) the tokens of the
requests in flight when the window reached it (admitted, not yet charged), plus (b) what the
other replicas admitted or charged since their last flush reached this one: per replica at most
flush_s + the watch's latency (a few ms) of its traffic. (b) is estimated rather than ignored
(inference_counts.Scope.estimate): each other replica busy in the last seconds is taken to have
counted, since its last record, the larger of its recent rate times the record's age and what
this replica counted since its own last flush (under load both replicas' flushes run late
together). Measured with two broker processes behind a model server answering in ~1 ms
(bench/openai_gateway.py: ~300 requests a second, 12,000 tokens per minute): 10-25 % over the
limit without the estimate, 1-3 % with it.

Writes. Each replica writes only its own keys: at most one transaction per flush_s, only when a
count changed, holding the changed tenants' records (at most MAX_PUTS keys, the rest the next
flush), each guarded on the key's mod_revision as this replica last saw it (a key whose last
write has not come back through the watch waits for the next flush). A record holds at most
WINDOW_S seconds per scope, so a key stays small however long it runs.

Dead replicas: their seconds age out by time; their month totals keep counting (they were
spent) until the month ends, after which any replica deletes keys of a past month (guarded,
every CLEANUP_S).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable

from pydantic import ValidationError

from broker.model.tenants import InferencePolicy, TokenLimits
from broker.state.inference_counts import (
    PEER_BUSY_S,
    WINDOW_S,
    InferenceStanding,
    LimitRecord,
    Months,
    Refusal,
    Scope,
    ScopeRecord,
    Used,
    Window,
    figures,
    month_of,
    over_budget,
    over_rate,
)
from routing.gateway.tally import Counts
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.registry.client import Guard, Registry
from sites.registry.mirror import KeyValues, PrefixMirror

__all__ = [
    "CLEANUP_S",
    "MAX_PUTS",
    "WINDOW_S",
    "InferenceLimits",
    "InferenceStanding",
    "LimitRecord",
    "Refusal",
    "ScopeRecord",
    "Used",
    "month_of",
]

log = logging.getLogger(__name__)

MAX_PUTS = 100
"""Keys one flush writes at most (etcd's --max-txn-ops is 128 by default)."""
CLEANUP_S = 60.0
"""How often a replica looks for keys of a past month to delete."""
QUIET_S = 1.0
"""How often the flush loop publishes a tenant far from its limits (`_far`): the others' view
of it may be this old, which their estimate of its unseen counts (its rate times its record's
age) covers; a tenant near a limit is published every flush_s."""
FAR_S = 10.0
"""A tenant is far from its limits when, at its recent rate (all replicas'), it would reach
none of them within this many seconds."""
_WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


# -- the replica's book ---------------------------------------------------------------------------


class InferenceLimits:
    """One per broker replica: admits inference requests against the limits of their tenant and
    token as all replicas together counted them (module docstring)."""

    def __init__(
        self,
        *,
        registry: Registry,
        writer: str,
        policy: Callable[[str], InferencePolicy | None],
        token_limits: Callable[[str], TokenLimits | None],
        clock: Clock,
        flush_s: float = 0.1,
    ) -> None:
        if not _WRITER_RE.match(writer):
            raise ValueError(f"writer {writer!r}: letters, digits, '.', '_', '-' (at most 63)")
        if not (math.isfinite(flush_s) and flush_s > 0):
            raise ValueError(f"flush_s must be a finite number > 0, got {flush_s}")
        self.registry = registry
        self.writer = writer
        self.flush_s = flush_s
        self.seq = 0  # the last flush written
        self._policy = policy
        self._token_limits = token_limits
        self._clock = clock
        self._months = Months()
        self._tenants: dict[str, Scope] = {}
        self._tokens: dict[str, Scope] = {}
        self._tenant_tokens: dict[str, set[str]] = {}  # tenant -> its counted tokens
        self._dirty: set[str] = set()  # tenants whose own counts changed since their flush
        self._records: dict[str, LimitRecord] = {}  # key -> the last record seen, every writer
        self._revisions: dict[str, int] = {}  # key -> mod_revision seen
        self._awaiting: dict[str, bytes] = {}  # own key -> what was written, until seen back
        self._sent: dict[str, LimitRecord] = {}  # own key -> the record written, until seen back
        self._latest: dict[str, int] = {}  # own key -> the newest mod_revision seen of it
        # tenant -> what the gateway counted on its own since the last take (`_take_counts`)
        self._counts: dict[str, Counts] = {}
        self._published: dict[str, float] = {}  # tenant -> when the loop last published it
        self._restored = False
        self._lock = asyncio.Lock()
        self.mirror = PrefixMirror(
            registry=registry,
            prefix=keys.INFERENCE_LIMITS,
            on_reset=self._reset,
            on_event=self._event,
            keep_items=False,
        )

    @property
    def synced(self) -> asyncio.Event:
        """Set once the registry was read: before that, the month's totals are not known."""
        return self.mirror.synced

    # -- the hot path (no I/O) ------------------------------------------------------------------

    def admit(self, tenant: str, token_id: str | None, now: float) -> Refusal | None:
        """None: go (the request is counted); else why not. O(1) amortized, no I/O."""
        self._take_counts(tenant, now)
        policy = self._policy(tenant)
        own = self._token_limits(token_id) if token_id is not None else None
        tenant_limited = policy is not None and policy.limited
        token_limited = own is not None and own.limited
        if not (tenant_limited or token_limited):
            return None
        second, month = int(now), self._months(now)
        scope = self._scope(tenant)
        key_scope = None
        if token_limited and token_id is not None:
            key_scope = self._token_scope(tenant, token_id)
        checks: list[tuple[Scope, TokenLimits, str, str]] = []
        if tenant_limited and policy is not None:
            checks.append((scope, policy, f"tenant {tenant}", f"tenants.{tenant}.inference"))
        if key_scope is not None and own is not None:
            checks.append((key_scope, own, f"token {token_id}", f"tokens.{token_id}.limits"))
        for s, limits, who, where in checks:
            refusal = over_budget(s, limits, who, where, month)
            if refusal is not None:
                return refusal
        for s, limits, who, where in checks:
            refusal = over_rate(s, limits, who, where, second, now)
            if refusal is not None:
                return refusal
        scope.own.add(second, 1, 0)
        scope.counted(1, 0)
        if key_scope is not None:
            key_scope.own.add(second, 1, 0)
            key_scope.counted(1, 0)
        self._dirty.add(tenant)
        return None

    def charge(
        self, tenant: str, token_id: str | None, *, tokens: int, usd: float, now: float
    ) -> None:
        """A finished request's tokens and cost (after the response: a stream is never cut)."""
        policy = self._policy(tenant)
        own = self._token_limits(token_id) if token_id is not None else None
        token_limited = own is not None and own.limited
        if not ((policy is not None and policy.limited) or token_limited):
            return
        self._take_counts(tenant, now)
        counts = self._counts.get(tenant)
        if counts is not None:
            counts.expire()  # its headroom did not see this charge
        tokens = max(0, int(tokens))
        usd = max(0.0, float(usd)) if math.isfinite(usd) else 0.0
        second, month = int(now), self._months(now)
        scopes = [self._scope(tenant)]
        if token_limited and token_id is not None:
            scopes.append(self._token_scope(tenant, token_id))
        for s in scopes:
            s.own.add(second, 0, tokens)
            s.counted(0, tokens)
            s.charge(month, tokens, usd)
        self._dirty.add(tenant)

    # -- the gateway's own counts (routing.gateway.tally) ----------------------------------------

    def counts(self, tenant: str, token_id: str | None) -> Counts | None:
        """The counts the gateway keeps for `tenant`'s requests with `token_id`; None when the
        token has limits of its own (those requests come here, `admit` and `charge`)."""
        own = self._token_limits(token_id) if token_id is not None else None
        if own is not None and own.limited:
            return None
        counts = self._counts.get(tenant)
        if counts is None:
            counts = self._counts[tenant] = Counts()
        return counts

    def grant(
        self, tenant: str, counts: Counts, now: float, until: float, horizon_s: float
    ) -> None:
        """Give `counts` the headroom `admit` would leave the tenant until unix now +
        `horizon_s` (`until` on the monotonic clock): each request or token counted in it
        raises the window by at most 1 + the busy peers (`Scope.estimate`: each peer's guess
        is at least this replica's unpublished counts), so the headroom is what is left
        below each limit divided by that; budgets are left as they are."""
        policy = self._policy(tenant)
        if policy is None or not policy.limited:
            counts.grant(False, until, 0, 0, 0.0)
            return
        scope = self._scope(tenant)
        big = 1 << 62
        requests_left, tokens_left, usd_left = big, big, math.inf
        budget = policy.budget
        if budget is not None:
            tokens, usd = scope.in_month(self._months(now))
            if budget.tokens_per_month is not None:
                tokens_left = budget.tokens_per_month - tokens
            if budget.usd_per_month is not None:
                usd_left = budget.usd_per_month - usd
        rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
        if rpm is not None or tpm is not None:
            later = now + horizon_s
            requests, tokens = scope.window(int(now))
            mine_requests, mine_tokens = scope.unpublished
            peers = 0
            for at, request_rate, token_rate in scope.peers.values():
                if later - at >= 0 and now - at <= PEER_BUSY_S:
                    age = max(0.0, later - at)
                    requests += max(math.ceil(request_rate * age), mine_requests)
                    tokens += max(math.ceil(token_rate * age), mine_tokens)
                    peers += 1
            if rpm is not None:
                requests_left = (rpm - requests) // (1 + peers)
            if tpm is not None:
                tokens_left = min(tokens_left, (tpm - tokens) // (1 + peers))
        counts.grant(True, until, requests_left, tokens_left, usd_left)

    def _take_counts(self, tenant: str, now: float) -> None:
        """What the gateway counted for `tenant` since the last take, into its scope."""
        counts = self._counts.get(tenant)
        if counts is None:
            return
        requests, tokens, usd = counts.take()
        if not (requests or tokens or usd):
            return
        second, month = int(now), self._months(now)
        scope = self._scope(tenant)
        scope.own.add(second, requests, tokens)
        scope.counted(requests, tokens)
        if tokens or usd:
            scope.charge(month, tokens, usd)
        self._dirty.add(tenant)

    def standing(self, tenant: str, now: float) -> dict[str, object]:
        """The tenant's limits and what all replicas used of them (`InferenceStanding` as JSON)."""
        self._take_counts(tenant, now)
        policy = self._policy(tenant) or InferencePolicy()
        second, month = int(now), self._months(now)
        scope = self._tenants.get(tenant)
        if scope is None:
            counts = (0, 0, 0, 0.0)
        else:
            counts = (*scope.window(second), *scope.in_month(month))
        tokens = {}
        for token_id in sorted(self._tenant_tokens.get(tenant, ())):
            s = self._tokens[token_id]
            counted = (*s.window(second), *s.in_month(month))
            tokens[token_id] = figures(self._token_limits(token_id), counted)
        standing = InferenceStanding(
            priority=policy.priority, month=month, tokens=tokens, **figures(policy, counts)
        )
        return standing.model_dump(mode="json")

    def heard(self, tenant: str, writer: str) -> int:
        """The seq of `writer`'s record for `tenant` this replica's mirror holds (0: none)."""
        got = self._records.get(keys.inference_limit(tenant, writer))
        return 0 if got is None else got.seq

    def _scope(self, tenant: str) -> Scope:
        scope = self._tenants.get(tenant)
        if scope is None:
            scope = self._tenants[tenant] = Scope()
        return scope

    def _token_scope(self, tenant: str, token_id: str) -> Scope:
        scope = self._tokens.get(token_id)
        if scope is None:
            scope = self._tokens[token_id] = Scope()
        self._tenant_tokens.setdefault(tenant, set()).add(token_id)
        return scope

    # -- the mirror -----------------------------------------------------------------------------

    def _reset(self, kvs: KeyValues) -> None:
        for counts in self._counts.values():
            counts.expire()
        for scope in (*self._tenants.values(), *self._tokens.values()):
            scope.others = Window()
            scope.other_months = {}
        self._records.clear()
        self._revisions.clear()
        self._awaiting.clear()
        self._sent.clear()
        self._latest.clear()
        month = self._months(self._clock.time())
        for key, value, rev in kvs:
            self._take(key, value, rev, month, restore=not self._restored)
        self._restored = True

    def _event(self, key: str, value: bytes | None, rev: int) -> None:
        self._take(key, value, rev, self._months(self._clock.time()), restore=False)

    def _take(self, key: str, value: bytes | None, rev: int, month: str, *, restore: bool) -> None:
        tenant, _, writer = key[len(keys.INFERENCE_LIMITS) :].rpartition("/")
        if not tenant or not writer:
            return
        new = None
        sent = self._sent.pop(key, None)
        if sent is not None and value is not None and value == self._awaiting.get(key):
            new = sent  # this replica's own write come back: not decoded again
        elif value is not None:
            new = _decode(key, value)
            if new is None:
                return  # unreadable: logged, the last good one kept
        old = self._records.pop(key, None)
        if new is not None:
            self._records[key] = new
        if writer == self.writer:
            # this replica's own counts are the ones it holds: its key is read back only when
            # it starts (restore), else only its revision is taken, for the next guard
            self._latest[key] = 0 if value is None else rev
            awaited = self._awaiting.get(key)
            if restore or awaited is None or awaited == value:
                self._awaiting.pop(key, None)
                self._revisions[key] = self._latest[key]
            if restore and new is not None and new.month == month:
                self._scope(tenant).restore(new, month)
                for token_id, got in new.by_token.items():
                    self._token_scope(tenant, token_id).restore(got, month)
            return
        self._revisions[key] = 0 if value is None else rev
        counts = self._counts.get(tenant)
        if counts is not None:
            counts.expire()  # another replica's counts: the headroom is looked at again
        at = new.at if new is not None else 0.0
        self._scope(tenant).apply_other(old, new, writer, at)
        tokens_old = {} if old is None else old.by_token
        tokens_new = {} if new is None else new.by_token
        for token_id in tokens_old.keys() | tokens_new.keys():
            self._token_scope(tenant, token_id).apply_other(
                tokens_old.get(token_id), tokens_new.get(token_id), writer, at
            )

    # -- writes ---------------------------------------------------------------------------------

    def _far(self, tenant: str, now: float) -> bool:
        """Whether `tenant`, at the rate all replicas counted it lately, would reach none of its
        limits within FAR_S (a token with limits of its own: never far)."""
        policy = self._policy(tenant)
        if policy is None or not policy.limited or self._tenant_tokens.get(tenant):
            return policy is None or not policy.limited
        scope = self._scope(tenant)
        second = int(now)
        counted_requests = counted_tokens = 0
        for s in range(second - PEER_BUSY_S + 1, second + 1):
            for window in (scope.own, scope.others):
                r, t = window.at(s)
                counted_requests += r
                counted_tokens += t
        rate_requests = counted_requests / PEER_BUSY_S
        rate_tokens = counted_tokens / PEER_BUSY_S
        requests, tokens = scope.estimate(now)
        rpm, tpm = policy.requests_per_minute, policy.tokens_per_minute
        if rpm is not None and rpm - requests <= FAR_S * rate_requests:
            return False
        if tpm is not None and tpm - tokens <= FAR_S * rate_tokens:
            return False
        budget = policy.budget
        if budget is not None:
            month_tokens, usd = scope.in_month(self._months(now))
            if budget.tokens_per_month is not None:
                if budget.tokens_per_month - month_tokens <= FAR_S * rate_tokens:
                    return False
            if budget.usd_per_month is not None:
                usd_rate = usd / month_tokens * rate_tokens if month_tokens else 0.0
                if budget.usd_per_month - usd <= FAR_S * usd_rate:
                    return False
        return True

    async def flush(self, now: float | None = None, *, paced: bool = False) -> bool:
        """Publish this replica's changed counts: one guarded transaction; True if written.
        `paced` (the loop's): a tenant far from its limits only every QUIET_S."""
        async with self._lock:
            if not self.mirror.synced.is_set():
                return False
            now = self._clock.time() if now is None else now
            for tenant in list(self._counts):
                self._take_counts(tenant, now)
            if not self._dirty:
                return False
            second, month = int(now), self._months(now)
            seq = self.seq + 1
            puts: dict[str, bytes] = {}
            guards: list[Guard] = []
            taken: list[str] = []
            for tenant in sorted(self._dirty):
                key = keys.inference_limit(tenant, self.writer)
                if key in self._awaiting:
                    continue  # its last write has not come back yet: its revision is unknown
                if (
                    paced
                    and now - self._published.get(tenant, -math.inf) < QUIET_S
                    and self._far(tenant, now)
                ):
                    continue
                record = self._record(tenant, second, month, seq, now)
                self._sent[key] = record
                puts[key] = record.model_dump_json().encode()
                guards.append(Guard(key, mod_revision=self._revisions.get(key, 0)))
                taken.append(tenant)
                if len(taken) >= MAX_PUTS:
                    break
            if not taken:
                return False
            self._dirty.difference_update(taken)
            # awaited before the commit: its watch event may come before the commit's answer
            self._awaiting.update(puts)
            try:
                ok = await self.registry.commit(guards=guards, puts=puts)
            except RegistryError:
                self._failed(taken, puts)
                raise
            if not ok:
                # another writer touched a key of ours (a past month's cleanup, or a second
                # replica misconfigured with this writer id): the watch brings its revision
                log.warning("inference limits: a key of writer %s changed meanwhile", self.writer)
                self._failed(taken, puts)
                return False
            self.seq = seq
            for tenant in taken:  # what the others had not seen of these is published now
                self._published[tenant] = now
                self._scope(tenant).published()
                for token_id in self._tenant_tokens.get(tenant, ()):
                    self._token_scope(tenant, token_id).published()
            return True

    def _failed(self, tenants: list[str], puts: dict[str, bytes]) -> None:
        self._dirty.update(tenants)
        for key in puts:
            self._awaiting.pop(key, None)
            self._sent.pop(key, None)
            self._revisions[key] = self._latest.get(key, self._revisions.get(key, 0))

    def _record(self, tenant: str, second: int, month: str, seq: int, now: float) -> LimitRecord:
        scope = self._scope(tenant)
        base = scope.record(second, month)
        by_token = {
            token_id: self._tokens[token_id].record(second, month)
            for token_id in sorted(self._tenant_tokens.get(tenant, ()))
        }
        return LimitRecord(
            **base.model_dump(), writer=self.writer, seq=seq, at=now, by_token=by_token
        )

    async def clean(self, now: float | None = None) -> int:
        """Delete keys of a past month whose seconds are out of the window (any writer's, each
        guarded on its mod_revision); the number deleted."""
        now = self._clock.time() if now is None else now
        month = self._months(now)
        old = int(now) - WINDOW_S
        stale = [
            key
            for key, got in self._records.items()
            if got.month < month
            and all(s <= old for s, _, _ in got.buckets)
            and all(t.month < month and all(s <= old for s, _, _ in t.buckets)
                    for t in got.by_token.values())
            and key not in self._awaiting
        ][:MAX_PUTS]  # fmt: skip
        if not stale:
            return 0
        guards = [Guard(key, mod_revision=self._revisions.get(key, 0)) for key in stale]
        if not await self.registry.commit(guards=guards, deletes=stale):
            return 0  # another replica did, or a writer wrote meanwhile: next time
        return len(stale)

    async def run(self) -> None:
        """Follow the prefix and flush every flush_s; clean past months every CLEANUP_S."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.mirror.run(), name=f"inference-limits mirror {self.writer}")
            tasks.create_task(self._flushing(), name=f"inference-limits flush {self.writer}")

    async def _flushing(self) -> None:
        await self.mirror.synced.wait()
        loop = asyncio.get_running_loop()
        cleaned = loop.time()
        while True:
            await self._clock.sleep(self.flush_s)
            try:
                await self.flush(paced=True)
                if loop.time() - cleaned >= CLEANUP_S:
                    cleaned = loop.time()
                    await self.clean()
            except RegistryError as exc:
                log.warning("inference limits: flush failed (%s); next in %ss", exc, self.flush_s)


def _decode(key: str, value: bytes) -> LimitRecord | None:
    try:
        return LimitRecord.model_validate_json(value)
    except ValidationError as exc:
        log.error("inference limits: %s does not validate, skipped: %s", key, exc)
        return None
