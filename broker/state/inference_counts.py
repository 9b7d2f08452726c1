"""What one broker replica counts of inference, and how it is published: the pure part of
broker.state.inference_limits (whose docstring has the design). No I/O, no clock reads.

`Window` holds requests and tokens per whole second over the last WINDOW_S seconds; `Scope` a
tenant's or a token's own and others' counts and month totals; `LimitRecord` is the registry's
value; `over_budget` and `over_rate` decide a `Refusal`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from broker.model.tenants import InferencePolicy, TokenLimits

__all__ = [
    "WINDOW_S",
    "InferenceStanding",
    "LimitRecord",
    "Months",
    "Refusal",
    "Scope",
    "ScopeRecord",
    "Used",
    "Window",
    "figures",
    "month_of",
    "over_budget",
    "over_rate",
]

WINDOW_S = 61
PEER_BUSY_S = 2
"""Another replica whose record counted something in its last PEER_BUSY_S seconds is busy: it
is taken to be counting as much as this one meanwhile (Scope.window)."""
"""One-second slots a window holds: the current second and the 60 before it, so any span of
60 s lies inside the window (a 60-slot window would cover 59.x s only)."""

# -- records (the registry's values) ------------------------------------------------------------


class ScopeRecord(BaseModel):
    """One scope's (a tenant's, or one token's) counts as one replica publishes them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    month: str = Field(description="YYYY-MM (UTC) that tokens and usd are of")
    tokens: int = Field(default=0, ge=0, description="charged this month")
    usd: float = Field(default=0.0, ge=0, description="charged this month")
    buckets: list[tuple[int, int, int]] = Field(
        default_factory=list, description="[unix second, requests, tokens] of the recent seconds"
    )


class LimitRecord(ScopeRecord):
    """/cpn/v1/inference-limits/<tenant>/<writer>: one replica's counts for one tenant."""

    writer: str
    seq: int = Field(ge=0, description="the writer's flush that wrote it")
    at: float = Field(description="unix s of that flush")
    by_token: dict[str, ScopeRecord] = Field(
        default_factory=dict, description="the tenant's tokens that have limits of their own"
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not admitted: 429 with Retry-After (should_retry) or with
    `x-should-retry: false` (a spent budget: waiting a minute will not help)."""

    status: int
    code: str  # "rate_limited" | "tokens_per_minute" | "budget_exhausted"
    message: str
    field: str  # the limit's place: tenants.<t>.inference.<limit>, tokens.<id>.limits.<limit>
    retry_after_s: float | None
    should_retry: bool

    @property
    def retry_after_header(self) -> str | None:
        """Retry-After takes whole seconds: rounded up, so a client that obeys succeeds."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


class Used(BaseModel):
    model_config = ConfigDict(frozen=True)

    used: int | float | None = Field(description="null: this broker does not count it (not wired)")
    limit: int | float | None = Field(description="null: not limited")


class InferenceStanding(BaseModel):
    """A tenant's inference limits and, where the broker counts them, what it used of each."""

    model_config = ConfigDict(frozen=True)

    priority: int = Field(description="its requests' default priority")
    requests_per_minute: Used
    tokens_per_minute: Used
    month: str = Field(description="YYYY-MM (UTC) the month's figures are of")
    tokens_this_month: Used
    usd_this_month: Used
    tokens: dict[str, dict[str, Used]] = Field(
        default_factory=dict, description="its tokens that have limits of their own, by id"
    )

    @classmethod
    def of(cls, policy: InferencePolicy, month: str) -> InferenceStanding:
        """The limits only (no counts): what a broker without InferenceLimits shows."""
        return cls(priority=policy.priority, month=month, **figures(policy, None))


def figures(
    limits: TokenLimits | None, counts: tuple[int, int, int, float] | None
) -> dict[str, Used]:
    """requests/tokens per minute and the month's tokens/usd: (used, limit) each."""
    budget = None if limits is None else limits.budget
    used = (None,) * 4 if counts is None else counts
    return {
        "requests_per_minute": Used(
            used=used[0], limit=None if limits is None else limits.requests_per_minute
        ),
        "tokens_per_minute": Used(
            used=used[1], limit=None if limits is None else limits.tokens_per_minute
        ),
        "tokens_this_month": Used(
            used=used[2], limit=None if budget is None else budget.tokens_per_month
        ),
        "usd_this_month": Used(
            used=None if used[3] is None else round(used[3], 6),
            limit=None if budget is None else budget.usd_per_month,
        ),
    }


# -- counting -------------------------------------------------------------------------------------


class Window:
    """Requests and tokens per whole second over the last WINDOW_S seconds, totals kept: adding
    and reading are O(1) amortized (a slot is cleared once as time passes it)."""

    __slots__ = ("_head", "_requests", "_seconds", "_tokens", "requests", "tokens")

    def __init__(self) -> None:
        self._seconds = [-1] * WINDOW_S
        self._requests = [0] * WINDOW_S
        self._tokens = [0] * WINDOW_S
        self._head = -1  # the newest second the slots are advanced to
        self.requests = 0
        self.tokens = 0

    def advance(self, second: int) -> None:
        head = self._head
        if second <= head:
            return
        seconds, requests, tokens = self._seconds, self._requests, self._tokens
        for s in range(max(head + 1, second - WINDOW_S + 1), second + 1):
            i = s % WINDOW_S
            self.requests -= requests[i]
            self.tokens -= tokens[i]
            seconds[i], requests[i], tokens[i] = s, 0, 0
        self._head = second

    def add(self, second: int, requests: int, tokens: int) -> None:
        if second > self._head:
            self.advance(second)
        elif second <= self._head - WINDOW_S:
            return  # out of the window already
        i = second % WINDOW_S
        self._requests[i] += requests
        self._tokens[i] += tokens
        self.requests += requests
        self.tokens += tokens

    def at(self, second: int) -> tuple[int, int]:
        i = second % WINDOW_S
        if self._seconds[i] != second:
            return 0, 0
        return self._requests[i], self._tokens[i]

    @property
    def head(self) -> int:
        return self._head

    def buckets(self, second: int) -> list[tuple[int, int, int]]:
        """[second, requests, tokens] of the non-empty seconds in the window at `second`."""
        self.advance(second)
        out = []
        seconds, requests, tokens = self._seconds, self._requests, self._tokens
        for s in range(self._head - WINDOW_S + 1, self._head + 1):
            i = s % WINDOW_S
            if seconds[i] == s and (requests[i] or tokens[i]):
                out.append((s, requests[i], tokens[i]))
        return out


@dataclass(slots=True)
class Scope:
    """A tenant's or a token's counts: this replica's own, and the other replicas' summed."""

    own: Window = field(default_factory=Window)
    others: Window = field(default_factory=Window)
    month: str = ""  # of own tokens/usd
    tokens: int = 0
    usd: float = 0.0
    other_months: dict[str, list[float]] = field(default_factory=dict)  # month -> [tokens, usd]
    # other writer busy lately -> (its record's time, its requests and tokens per second over
    # the last PEER_BUSY_S seconds of that record): what it counted unseen since (`estimate`)
    peers: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # requests and tokens this replica counted since it last published: under load the
    # replicas' flushes and watches run late together, and at even shares of the traffic a
    # peer counted about this much unseen too (`estimate` takes the larger guess)
    unpublished: list[int] = field(default_factory=lambda: [0, 0])

    def window(self, second: int) -> tuple[int, int]:
        """Requests and tokens in the window: this replica's own and the others' as published."""
        self.own.advance(second)
        self.others.advance(second)
        return (self.own.requests + self.others.requests, self.own.tokens + self.others.tokens)

    def estimate(self, now: float) -> tuple[int, int]:
        """`window`, plus what each other replica busy lately counted since its last record,
        which reaches here a flush interval and a watch late: the larger of its rate over that
        record's last PEER_BUSY_S seconds times the record's age, and what this replica counted
        since it last published (under load both replicas' flushes run late). Without it two
        replicas each fill what the other filled unseen (at a fast model server's rate, 10-25 %
        over a tokens-per-minute limit: bench/openai_gateway.py)."""
        requests, tokens = self.window(int(now))
        if self.peers:
            mine_requests, mine_tokens = self.unpublished
            for at, request_rate, token_rate in self.peers.values():
                age = now - at
                if 0 <= age <= PEER_BUSY_S:
                    requests += max(math.ceil(request_rate * age), mine_requests)
                    tokens += max(math.ceil(token_rate * age), mine_tokens)
        return requests, tokens

    def counted(self, requests: int, tokens: int) -> None:
        """This replica counted a request, or a request's tokens (not yet published)."""
        self.unpublished[0] += requests
        self.unpublished[1] += tokens

    def published(self) -> None:
        self.unpublished = [0, 0]

    def in_month(self, month: str) -> tuple[int, float]:
        other = self.other_months.get(month)
        tokens, usd = (0, 0.0) if other is None else (int(other[0]), other[1])
        if self.month == month:
            tokens, usd = tokens + self.tokens, usd + self.usd
        return tokens, usd

    def charge(self, month: str, tokens: int, usd: float) -> None:
        if self.month != month:
            self.month, self.tokens, self.usd = month, 0, 0.0
        self.tokens += tokens
        self.usd += usd

    def retry_after(self, now: float, limit: int, which: int) -> float:
        """Seconds until the window's requests (which=0) or tokens (1) drop below `limit`."""
        second = int(now)
        head = max(second, self.own.head, self.others.head)
        total = self.window(second)[which]
        for s in range(head - WINDOW_S + 1, head + 1):
            total -= self.own.at(s)[which] + self.others.at(s)[which]
            if total < limit:
                return max(0.001, s + WINDOW_S - now)
        return float(WINDOW_S)

    def record(self, second: int, month: str) -> ScopeRecord:
        return ScopeRecord(
            month=self.month or month,
            tokens=self.tokens,
            usd=round(self.usd, 9),
            buckets=self.own.buckets(second),
        )

    def restore(self, got: ScopeRecord, month: str) -> None:
        """Add this replica's own published counts (read back when it starts)."""
        for s, r, t in got.buckets:
            self.own.add(s, r, t)
        if got.month == month:
            self.charge(month, got.tokens, got.usd)

    def apply_other(
        self,
        old: ScopeRecord | None,
        new: ScopeRecord | None,
        writer: str = "",
        at: float = 0.0,
    ) -> None:
        """Another replica's record replaced (`new` None: deleted): the differences added.
        `writer` busy at `at` (its record written then with counts in its last seconds) is a
        peer the window estimates unseen counts for."""
        if writer:
            since = int(at) - PEER_BUSY_S
            recent = [] if new is None else [(r, t) for s, r, t in new.buckets if s >= since]
            if recent:
                span = at - since  # the seconds those buckets cover, to the record's time
                self.peers[writer] = (
                    at,
                    sum(r for r, _ in recent) / span,
                    sum(t for _, t in recent) / span,
                )
            else:
                self.peers.pop(writer, None)
        if old is not None:
            sums = self.other_months.get(old.month)
            if sums is not None:
                sums[0] -= old.tokens
                sums[1] -= old.usd
                if sums[0] <= 0 and sums[1] <= 1e-12:
                    del self.other_months[old.month]
        if new is None:
            return  # its seconds stay until they age out
        sums = self.other_months.setdefault(new.month, [0.0, 0.0])
        sums[0] += new.tokens
        sums[1] += new.usd
        before = {} if old is None else {s: (r, t) for s, r, t in old.buckets}
        for s, r, t in new.buckets:
            r0, t0 = before.get(s, (0, 0))
            if r != r0 or t != t0:
                self.others.add(s, r - r0, t - t0)


class Months:
    """YYYY-MM of a unix time, cached for the month in progress (admit asks every request)."""

    def __init__(self) -> None:
        self._start = self._end = 0.0
        self._label = ""

    def __call__(self, now: float) -> str:
        if not self._start <= now < self._end:
            day = datetime.fromtimestamp(now, UTC)
            start = day.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            end = (
                start.replace(year=start.year + 1, month=1)
                if start.month == 12
                else (start.replace(month=start.month + 1))
            )
            self._start, self._end = start.timestamp(), end.timestamp()
            self._label = start.strftime("%Y-%m")
        return self._label


def month_of(now: float) -> str:
    """The calendar month (UTC, YYYY-MM) a unix time falls in."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m")


def over_budget(
    scope: Scope, limits: TokenLimits, who: str, where: str, month: str
) -> Refusal | None:
    budget = limits.budget
    if budget is None:
        return None
    tokens, usd = scope.in_month(month)
    if budget.tokens_per_month is not None and tokens >= budget.tokens_per_month:
        return Refusal(
            429,
            "budget_exhausted",
            f"{who} has used {tokens:,} tokens of its budget of {budget.tokens_per_month:,} "
            f"tokens_per_month in {month} (UTC)",
            f"{where}.budget.tokens_per_month",
            None,
            False,
        )
    if budget.usd_per_month is not None and usd >= budget.usd_per_month:
        return Refusal(
            429,
            "budget_exhausted",
            f"{who} has spent ${usd:,.2f} of its budget of ${budget.usd_per_month:,.2f} "
            f"usd_per_month in {month} (UTC)",
            f"{where}.budget.usd_per_month",
            None,
            False,
        )
    return None


def over_rate(
    scope: Scope, limits: TokenLimits, who: str, where: str, second: int, now: float
) -> Refusal | None:
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    if rpm is None and tpm is None:
        return None
    requests, tokens = scope.estimate(now)
    seen = scope.window(second)
    unseen = (requests - seen[0], tokens - seen[1])  # the others' estimated since their records
    if rpm is not None and requests >= rpm:
        wait = scope.retry_after(now, max(1, rpm - unseen[0]), 0)
        return Refusal(
            429,
            "rate_limited",
            f"{who} made {requests:,} requests in the last minute, its limit of {rpm:,} "
            f"requests_per_minute; retry in {math.ceil(wait)} s",
            f"{where}.requests_per_minute",
            wait,
            True,
        )
    if tpm is not None and tokens >= tpm:
        wait = scope.retry_after(now, max(1, tpm - unseen[1]), 1)
        return Refusal(
            429,
            "tokens_per_minute",
            f"{who} used {tokens:,} tokens in the last minute, its limit of {tpm:,} "
            f"tokens_per_minute; retry in {math.ceil(wait)} s",
            f"{where}.tokens_per_minute",
            wait,
            True,
        )
    return None
