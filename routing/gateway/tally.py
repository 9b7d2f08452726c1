"""Token accounting on the gateway's request path, compiled with it: per request no call into
interpreted code (docs/openai.md, "Token accounting"; bench/JOURNAL.md, 2026-12-07, night).

`Tally` is the proxy's `Accountant`. What a request does to the books is sums, kept here:

- admission: a tenant's `Counts` hold the headroom the broker's limits granted it
  (requests, tokens and USD it may still take before they look again, valid until `until` on
  the monotonic clock, at most a limits flush away) and what it took since; a request within
  the headroom is admitted and counted here. The limits (broker.state.inference_limits) take
  the counts at each flush, and look again (`Books.admit`) when the headroom is spent, has
  expired, or another replica's counts arrived: they hold the limits' exact rule, this only
  answers the requests that rule would admit as well.
- settlement: an answer's tokens go into its `Account` (one per tenant, token, requested
  model, service, site and client region): its token-ledger `Row` (the sums of one day,
  tenant, model, site and client region since the ledger's last flush, written ahead into
  the row's slot of the ledger's mapped file by plain stores), its price, its metric sums and
  its tenant's `Counts`. An account is looked up again (`Books.account`, interpreted) when
  its row was taken by a flush, its day ended, or a second passed (prices change).
- a stream: a slot of the ledger's file written ahead before its first byte (a copy of the
  account's slot image, the request id, the prompt estimate, then the state byte), into
  which the answer's Meter stores the delivered chunks; at its end its tokens go into the row
  and the slot is freed.

Slots are the ledger's (broker.state.token_ledger: layout, recovery); `SlotFile` is its file
as the words this code writes, and its list of free slots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "MAX_TOKENS",
    "Account",
    "Billed",
    "Books",
    "Counts",
    "Gate",
    "Row",
    "SlotFile",
    "Stream",
    "Tally",
]

Extra = Sequence[tuple[str, str]]  # as routing.gateway.proxy.Extra: headers of a refusal

MAX_TOKENS = 1 << 40  # a count above this is clamped (as the ledger's)
REFRESH_S = 1.0  # an account is looked up again at least this often (a price may change)
_OPEN = 1  # a slot's state byte: open (broker.state.token_ledger)
_REQUEST_ID_AT = 80  # the byte offset of a slot's request id, and its size
_REQUEST_ID_SIZE = 64
_MAX_ACCOUNTS = 4096


def _count(n: int) -> int:
    if n < 0:
        return 0
    return MAX_TOKENS if n > MAX_TOKENS else n


class Billed:
    """Whom a metered answer is billed to, and what served it (a native class: the proxy
    makes one per metered request and this module reads its fields, each a load)."""

    __slots__ = ("request_id", "tenant", "token_id", "requested", "service", "site", "region")

    def __init__(
        self,
        request_id: str,  # X-Request-Id ("": none)
        tenant: str,
        token_id: str | None,  # the caller's API token (per-token limits)
        requested: str,  # the model the client named: a model, a service or an alias
        service: str,
        site: str,
        region: str,  # the client region
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.token_id = token_id
        self.requested = requested
        self.service = service
        self.site = site
        self.region = region

    def __repr__(self) -> str:
        return (
            f"Billed({self.request_id!r}, {self.tenant!r}, {self.token_id!r}, "
            f"{self.requested!r}, {self.service!r}, {self.site!r}, {self.region!r})"
        )


class Clock(Protocol):
    def time(self) -> float: ...

    def monotonic(self) -> float: ...


class SlotFile:
    """The token ledger's mapped file as this code writes it: int64 words, float64 words and
    bytes over the same map, the slots' geometry, and the ledger's free slots (one list,
    shared). `release()` when the ledger unmaps: writes after it are skipped."""

    def __init__(
        self,
        words: memoryview | None,
        floats: memoryview[float] | None,
        octets: memoryview | None,
        free: list[int],
        header: int,
        size: int,
    ) -> None:
        self.words = words
        self.floats = floats
        self.octets = octets
        self.free = free
        self.header = header
        self.size = size

    def release(self) -> None:
        for view in (self.words, self.floats, self.octets):
            if view is not None:
                view.release()
        self.words = self.floats = self.octets = None

    def offset(self, slot: int) -> int:
        return self.header + slot * self.size

    def free_slot(self, slot: int) -> None:
        """The slot's state byte set free (its word: the flags go too, which a free slot has
        none of) and the slot given back."""
        words = self.words
        if words is None:
            return
        try:
            words[self.offset(slot) // 8] = 0
        except ValueError:
            return
        self.free.append(slot)


class Row:
    """A token-ledger row's sums since the ledger's last flush (`live` until a flush takes
    them), stored into its slot as they grow: requests and counted requests at `word`, then
    prompt, completion and cached tokens, the last use's time and the USD (-1: no slot)."""

    def __init__(self, file: SlotFile | None, word: int) -> None:
        self.file = file
        self.word = word
        self.live = True
        self.requests = 0
        self.counted = 0
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.at = 0.0
        self.usd = 0.0

    def add(
        self, prompt: int, completion: int, cached: int, counted: bool, usd: float, at: float
    ) -> None:
        self.requests += 1
        if counted:
            self.counted += 1
        self.prompt += prompt
        self.completion += completion
        self.cached += cached
        self.usd += usd
        self.at = at
        file = self.file
        if file is None or self.word < 0:
            return
        words = file.words
        floats = file.floats
        if words is None or floats is None:
            return
        w = self.word
        try:
            words[w] = self.requests
            words[w + 1] = self.counted
            words[w + 2] = self.prompt
            words[w + 3] = self.completion
            words[w + 4] = self.cached
            floats[w + 5] = at
            floats[w + 6] = self.usd
        except ValueError:  # unmapped (the broker stopping): the sums stay in memory
            self.file = None


class Counts:
    """A tenant's admission headroom, granted by the limits, and what it took since the limits
    last took its counts (module docstring). `limited` False: nothing to count."""

    def __init__(self) -> None:
        self.limited = False
        self.until = 0.0  # monotonic; 0: ask the limits
        self.requests_left = 0
        self.tokens_left = 0
        self.usd_left = 0.0
        self.requests = 0
        self.tokens = 0
        self.usd = 0.0

    def grant(
        self, limited: bool, until: float, requests_left: int, tokens_left: int, usd_left: float
    ) -> None:
        self.limited = limited
        self.until = until
        self.requests_left = requests_left
        self.tokens_left = tokens_left
        self.usd_left = usd_left

    def expire(self) -> None:
        self.until = 0.0

    def take(self) -> tuple[int, int, float]:
        """What was counted since the last take: (requests, tokens, USD), zeroed."""
        taken = (self.requests, self.tokens, self.usd)
        self.requests = 0
        self.tokens = 0
        self.usd = 0.0
        return taken

    def charge(self, tokens: int, usd: float) -> None:
        if self.limited:
            self.tokens += tokens
            self.usd += usd
            self.tokens_left -= tokens
            self.usd_left -= usd


class Gate:
    """A (tenant, token) pair the limits found without limits of the token's own, until
    `until`: its requests are admitted on its tenant's `counts`."""

    def __init__(self, counts: Counts, until: float) -> None:
        self.counts = counts
        self.until = until


class Account:
    """Where the answers of one (tenant, token, requested model, service, site, client region)
    go: its ledger row, price (USD per token), metric sums ([prompt, completion, cached,
    requests]), tenant counts (None: the token has limits of its own, charged by the books),
    a stream slot's image (None: its names do not fit a slot) with its flags."""

    def __init__(
        self,
        *,
        row: Row,
        input_usd: float,
        output_usd: float,
        cached_usd: float,
        metric: list[int],
        counts: Counts | None,
        template: bytes | None,
        until: float,
    ) -> None:
        self.row = row
        self.input_usd = input_usd
        self.output_usd = output_usd
        self.cached_usd = cached_usd
        self.metric = metric
        self.counts = counts
        self.template = template
        self.until = until  # unix s: looked up again from then (its day's end at most)

    def cost(self, prompt: int, completion: int, cached: int) -> float:
        usd = (
            (prompt - cached) * self.input_usd
            + cached * self.cached_usd
            + completion * self.output_usd
        )
        return usd if math.isfinite(usd) and usd > 0 else 0.0


class Books(Protocol):
    """The broker's side (broker.api.inference.TokenAccountant), called when the sums here
    cannot answer: interpreted, and rare."""

    def admit(self, tenant: str, token_id: str | None) -> tuple[int, str, str, str, Extra] | None:
        """The limits' own rule; it grants the tenant's headroom (`Tally.gate`)."""

    def account(self, billed: Billed, at: float) -> Account:
        """`billed`'s account as of unix `at`."""

    def charge(self, tenant: str, token_id: str | None, tokens: int, usd: float, at: float) -> None:
        """A settled answer of a token with limits of its own."""


class Stream:
    """A streamed answer's write-ahead slot (the proxy's Ticket): `words[word]` is where its
    Meter stores the delivered chunks (None: no slot, `progress` does nothing)."""

    def __init__(
        self, tally: Tally, billed: Billed, slot: int, words: memoryview | None, word: int
    ) -> None:
        self.tally = tally
        self.billed = billed
        self.slot = slot
        self.words = words
        self.word = word
        self.settled = False

    def progress(self, completion_tokens: int) -> None:
        words = self.words
        if words is not None and not self.settled:
            try:
                words[self.word] = _count(completion_tokens)
            except ValueError:
                self.words = None

    def settle(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, counted: bool
    ) -> None:
        """Its tokens into its row, then its slot freed (a kill between the two bills the
        stream twice, never loses it); once."""
        if self.settled:
            return
        self.settled = True
        tally = self.tally
        tally.settle(self.billed, (prompt_tokens, completion_tokens, cached_tokens), counted)
        if self.slot >= 0:
            tally.file.free_slot(self.slot)


class Tally:
    """The proxy's Accountant (module docstring)."""

    def __init__(self, *, books: Books, clock: Clock, file: SlotFile) -> None:
        self.books = books
        self.clock = clock
        self.file = file
        self.gates: dict[tuple[str, str | None], Gate] = {}
        self.accounts: dict[tuple[str, str | None, str, str, str, str], Account] = {}

    # -- admission --------------------------------------------------------------------------

    def admit(self, tenant: str, token_id: str | None) -> tuple[int, str, str, str, Extra] | None:
        gate = self.gates.get((tenant, token_id))
        if gate is not None:
            now = self.clock.monotonic()
            counts = gate.counts
            if now < gate.until and now < counts.until:
                if not counts.limited:
                    return None
                if counts.requests_left > 0 and counts.tokens_left > 0 and counts.usd_left > 0:
                    counts.requests_left -= 1
                    counts.requests += 1
                    return None
        return self.books.admit(tenant, token_id)

    def gate(self, tenant: str, token_id: str | None, counts: Counts, until: float) -> None:
        """Admit (tenant, token)'s requests on `counts` until `until` (monotonic)."""
        gate = self.gates.get((tenant, token_id))
        if gate is None:
            if len(self.gates) >= _MAX_ACCOUNTS:
                self.gates.clear()
            self.gates[(tenant, token_id)] = Gate(counts, until)
        else:
            gate.counts = counts
            gate.until = until

    def shut(self, tenant: str, token_id: str | None) -> None:
        """(tenant, token)'s next request goes to the books."""
        gate = self.gates.get((tenant, token_id))
        if gate is not None:
            gate.until = 0.0

    # -- settlement -------------------------------------------------------------------------

    def account(self, billed: Billed, at: float) -> Account:
        key = (billed.tenant, billed.token_id, billed.requested, billed.service, billed.site,
               billed.region)  # fmt: skip
        found = self.accounts.get(key)
        if found is not None and found.row.live and at < found.until:
            return found
        made = self.books.account(billed, at)
        if found is None and len(self.accounts) >= _MAX_ACCOUNTS:
            self.accounts.clear()
        self.accounts[key] = made
        return made

    def settle(self, billed: Billed, usage: tuple[int, int, int], counted: bool) -> None:
        """An answer that reached the client: (prompt, completion, cached) tokens."""
        at = self.clock.time()
        account = self.account(billed, at)
        prompt = _count(usage[0])
        completion = _count(usage[1])
        cached = min(_count(usage[2]), prompt)
        usd = account.cost(prompt, completion, cached)
        account.row.add(prompt, completion, cached, counted, usd, at)
        metric = account.metric
        metric[0] += prompt
        metric[1] += completion
        metric[2] += cached
        metric[3] += 1
        counts = account.counts
        if counts is not None:
            counts.charge(prompt + completion, usd)
        else:
            self.books.charge(billed.tenant, billed.token_id, prompt + completion, usd, at)

    def open(self, billed: Billed, prompt_tokens: int) -> Stream:
        """A stream written ahead before its first byte: its slot holds its names, the prompt
        estimate and (as the Meter stores it) what reached the client."""
        at = self.clock.time()
        account = self.account(billed, at)
        file = self.file
        template = account.template
        octets = file.octets
        words = file.words
        floats = file.floats
        if template is None or octets is None or words is None or floats is None:
            return Stream(self, billed, -1, None, -1)
        if not file.free:
            return Stream(self, billed, -1, None, -1)
        slot = file.free.pop()
        off = file.offset(slot)
        w = off // 8
        prompt = _count(prompt_tokens)
        rid = billed.request_id.encode("utf-8", "surrogatepass")
        if len(rid) > _REQUEST_ID_SIZE or rid.find(b"\0") >= 0:  # it names the stream in logs only
            rid = rid.replace(b"\0", b"")[:_REQUEST_ID_SIZE]
        try:
            octets[off : off + len(template)] = template
            if rid:
                at_rid = off + _REQUEST_ID_AT
                octets[at_rid : at_rid + len(rid)] = rid
            floats[w + 1] = at  # opened at
            words[w + 2] = 0  # delivered
            words[w + 3] = prompt
            words[w + 4] = prompt  # the final prompt, until it settles
            floats[w + 7] = at
            octets[off] = _OPEN  # last: a slot is open only with all of it written
        except ValueError:  # unmapped (the broker stopping)
            return Stream(self, billed, -1, None, -1)
        return Stream(self, billed, slot, words, w + 2)
