"""The token ledger: a broker replica's inference tokens, written ahead to a local file and
settled into etcd exactly once (docs/metering.md, "Inference tokens: settlement").

The gateway opens a `Ticket` before a stream's first byte reaches its client, reports the
tokens delivered so far per chunk (`Ticket.progress`) and settles it at the end; a whole answer
is settled at once (`TokenLedger.settle`). Each lives in a slot of a file mapped MAP_SHARED in
the replica's state_dir: a write to it is a store into the page cache, which outlives the
process, so a broker killed mid-stream (SIGKILL included) leaves every open stream's prompt and
delivered tokens behind. `run` recovers them when the broker starts again (an open slot is
settled with what reached the client, `counted=True`) and then flushes every `flush_s`.

A settled use goes into its row: the sums of one (UTC day, tenant, model, site, client region)
since the last flush, in one slot (state 3) claimed by the row's first use. A stream's own slot
is freed once its numbers are in the row; a whole answer never has one. So between two
flushes the file holds a slot per row and per open stream, and a flush costs per row, not per
request. A flush sums the queued rows per (UTC day, tenant) into that replica's TokenDay keys
(sites.model.keys.usage_tokens), read just before, in one etcd transaction guarded on their
mod_revisions, with TokenDay.seq set to the flush's number. A slot records the first flush it
went into and is freed only after that flush committed. The replica is the only writer of its
keys, and every flush that commits on a key carries every use of that key still pending, so
`day.seq >= slot's flush` says the slot's use is in (a retried flush, or one replayed after a
crash between commit and free, adds nothing); below it, it is not, and goes into the next.

The file (`token-ledger.bin`, locked with flock so two processes never share one):

    header (128 B): magic b"CPNTOKL1", version u32, slot size u32, slots u32, pad u32,
                    flush seq i64 (the last flush number used), writer (64 B, NUL-padded)
    slot (768 B):   state u8 (0 free, 1 open, 2 settled, 3 a row), flags u8 (1 counted, 2 has
                    a token), pad, opened_at f64, delivered i64 (progress writes only this; a
                    row's requests), prompt i64 (a row's counted requests),
                    final prompt i64, final completion i64, cached i64, at f64, usd f64,
                    flush seq i64 (0: in no flush yet), then NUL-padded UTF-8 strings:
                    request id 64, tenant 64, token id 64, requested 128, service 64,
                    model 128, site 64, client region 64 (bytes)

A request id longer than its field is cut (it names the settlement in logs only); any other
name longer than its field, or holding a NUL, is kept in memory only, without a slot, as is a
use settled while every slot is taken: such a use is flushed like the rest but not recovered
after a kill (logged once per process).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from broker.model.errors import BrokerError, StaleRecord
from metering.tokens import TokenDay, TokenRow, TokenUse, cost_usd, row_key, token_day
from routing.gateway.tally import Row, SlotFile
from sites.kits.clock import Clock, SystemClock
from sites.model import keys
from sites.model.errors import RegistryError
from sites.model.spec import TokenPrice
from sites.registry.client import Guard, Registry

__all__ = [
    "FILE_NAME",
    "MAX_TOKENS",
    "SLOT_SIZE",
    "Ticket",
    "TokenLedger",
    "TokenLedgerError",
]

log = logging.getLogger(__name__)

FILE_NAME = "token-ledger.bin"
WRITER_FILE = "token-ledger.writer"
WRITER_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")  # a key segment (sites.model.spec NAME_RE)
MAX_TOKENS = 1 << 40  # a count above this is clamped: no request has a trillion tokens
KEYS_PER_TXN = 32  # TokenDay keys per transaction: far below etcd's ops and bytes limits
MAX_ATTEMPTS = 5  # guarded commits lost in one flush before it gives up until the next
MAX_BACKOFF_S = 5.0  # a billing ledger catches up soon after etcd is back

_MAGIC = b"CPNTOKL1"
_VERSION = 1
_HEADER = struct.Struct("<8sIIIIq64s")
_HEADER_SIZE = 128
_SEQ_AT = 24  # the header's flush seq
_SEQ = struct.Struct("<q")

FREE, OPEN, SETTLED, ROW = 0, 1, 2, 3
_COUNTED, _HAS_TOKEN = 1, 2
# the strings of a slot: (field, bytes)
_STRINGS = (
    ("request_id", 64),
    ("tenant", 64),
    ("token_id", 64),
    ("requested", 128),
    ("service", 64),
    ("model", 128),
    ("site", 64),
    ("client_region", 64),
)
_SLOT = struct.Struct("<BB6xdqqqqqddq" + "".join(f"{n}s" for _, n in _STRINGS))
SLOT_SIZE = 768
_DELIVERED_AT = 16
_FINAL = struct.Struct("<qqqddq")  # final prompt, completion, cached, at, usd, flush seq
_FINAL_AT = 32
_MARK_AT = 72
if _SLOT.size > SLOT_SIZE or _HEADER.size > _HEADER_SIZE:  # pragma: no cover - a layout edit
    raise RuntimeError("the token ledger's slot or header outgrew its size")

Price = Callable[[str, str, float], TokenPrice | None]


class _LostRace(Exception):
    """A flush's guarded commit failed; `done`: uses found in already on that try."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


_WRITTEN_MAX = 4096  # TokenDay keys whose last written value a ledger keeps (one per tenant a day)


class TokenLedgerError(BrokerError):
    """The ledger's file cannot be used (another process holds it, another writer's, not a
    ledger), or a TokenDay key in etcd does not decode."""


def _count(value: object) -> int:
    """A token count as given by a server or a client: clamped to [0, MAX_TOKENS], 0 if it is
    not a number."""
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value):
        n = int(value)
    else:
        return 0
    return min(max(n, 0), MAX_TOKENS)


_NAMES_MAX = 4096


def _encode(text: str, size: int) -> bytes | None:
    """`text` as a slot holds it, None when it does not fit (kept per identity by _names)."""
    data = text.encode("utf-8", "surrogatepass")
    return None if len(data) > size or b"\0" in data else data


def _cut(text: str, size: int) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= size and b"\0" not in data:
        return data  # the common request id
    data = data.replace(b"\0", b"")[:size]
    return data.decode("utf-8", "ignore").encode()


# (tenant, token id, requested, service, model, site, client region) -> their slot fields
# (_STRINGS after the request id), None when one does not fit: they repeat request to request
_NAMES: dict[tuple[str, str | None, str, str, str, str, str], tuple[bytes, ...] | None] = {}


def _names(use: TokenUse) -> tuple[bytes, ...] | None:
    key = (use.tenant, use.token_id, use.requested, use.service, use.model, use.site,
           use.client_region)  # fmt: skip
    found = _NAMES.get(key, ())
    if found != ():
        return found
    texts = [_encode(value or "", size) for value, (_, size) in zip(key, _STRINGS[1:], strict=True)]
    names = None if None in texts else tuple(t for t in texts if t is not None)
    if len(_NAMES) >= _NAMES_MAX:
        _NAMES.clear()
    _NAMES[key] = names
    return names


def _decode(data: bytes) -> str:
    return data.rstrip(b"\0").decode("utf-8", "replace")


@dataclass(slots=True)
class _Pending:
    """Settled uses waiting for a flush: one (a recovered slot), or the sums of a row's
    (`TokenLedger._add`: one per day, tenant, model, site and client region between flushes);
    `use` names them (its counts are the first use's, not the sums)."""

    use: TokenUse
    usd: float
    slot: int  # -1: none (memory only)
    mark: int  # the first flush it went into; 0: none yet
    requests: int = 1
    counted: int = 0  # requests whose tokens the gateway counted
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    row: Row | None = None  # a row's live sums, until a flush takes them (`_take_rows`)

    @classmethod
    def one(cls, use: TokenUse, usd: float, slot: int, mark: int) -> _Pending:
        return cls(
            use, usd, slot, mark, 1, int(use.counted), use.prompt_tokens,
            use.completion_tokens, use.cached_tokens,
        )  # fmt: skip


class Ticket:
    """One streamed request's tokens, from before its first byte to its end."""

    __slots__ = ("_ledger", "_offset", "_opened", "_settled", "slot", "usd")

    def __init__(self, ledger: TokenLedger, slot: int, opened: TokenUse) -> None:
        self._ledger = ledger
        self.slot = slot  # -1: kept in memory only (no slot free, or a name too long)
        self._offset = ledger.slot_offset(slot) + _DELIVERED_AT if slot >= 0 else -1
        self._opened = opened  # the identity, with prompt tokens and zero completion
        self._settled: TokenUse | None = None
        self.usd = 0.0  # what its settlement cost

    @property
    def words(self) -> memoryview | None:
        """The mapped file as int64 words, for the gateway's Meter to store the delivered
        count into itself (routing.gateway.openai.Meter.track); None: no slot."""
        return self._ledger.words if self._offset >= 0 else None

    @property
    def word(self) -> int:
        """The index of this ticket's delivered count in `words` (-1: none)."""
        return self._offset // _SEQ.size if self._offset >= 0 else -1

    def progress(self, completion_tokens: int) -> None:
        """Tokens that reached the client so far: one store into the mapped slot."""
        if self._settled is not None:
            return
        mm = self._ledger.mapped
        if self._offset >= 0 and mm is not None:
            _SEQ.pack_into(mm, self._offset, _count(completion_tokens))

    def settle(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, counted: bool
    ) -> TokenUse:
        """The stream ended: its usage (the server's last chunk, or counted by the gateway).
        A second call returns the first settlement."""
        if self._settled is not None:
            return self._settled
        prompt = _count(prompt_tokens)
        use = _replace_counts(
            self._opened,
            prompt=prompt,
            completion=_count(completion_tokens),
            cached=min(_count(cached_tokens), prompt),
            at=self._ledger.now(),
            counted=counted,
        )
        self._settled = use
        self.usd = self._ledger.settle_slot(self.slot, use)
        return use

    def abandon(self) -> None:
        """Nothing reached the client: bill nothing."""
        if self._settled is not None:
            return
        self._settled = self._opened
        self._ledger.free_slot(self.slot)


def _sane(use: TokenUse) -> bool:
    """Whether a use's counts and time are already what the ledger would clamp them to (the
    gateway's are): the common case skips the copy."""
    prompt, completion, cached = use.prompt_tokens, use.completion_tokens, use.cached_tokens
    return (
        type(prompt) is int
        and type(completion) is int
        and type(cached) is int
        and 0 <= prompt <= MAX_TOKENS
        and 0 <= completion <= MAX_TOKENS
        and 0 <= cached <= prompt
        and type(use.at) is float
        and math.isfinite(use.at)
        and type(use.counted) is bool
    )


def _clamped(use: TokenUse, now: float) -> TokenUse:
    """`use` with its counts clamped and a bad time replaced by `now`."""
    prompt = _count(use.prompt_tokens)
    at = use.at if isinstance(use.at, float | int) and math.isfinite(use.at) else now
    return _replace_counts(
        use,
        prompt=prompt,
        completion=_count(use.completion_tokens),
        cached=min(_count(use.cached_tokens), prompt),
        at=float(at),
        counted=bool(use.counted),
    )


def _replace_counts(
    use: TokenUse, *, prompt: int, completion: int, cached: int, at: float, counted: bool
) -> TokenUse:
    return TokenUse(
        request_id=use.request_id,
        tenant=use.tenant,
        token_id=use.token_id,
        model=use.model,
        requested=use.requested,
        service=use.service,
        site=use.site,
        client_region=use.client_region,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        at=at,
        counted=counted,
    )


class TokenLedger:
    """A broker replica's write-ahead token ledger and its flushes into etcd."""

    def __init__(
        self,
        *,
        registry: Registry,
        writer: str,
        state_dir: Path,
        price: Price,
        clock: Clock | None = None,
        flush_s: float = 0.5,
        slots: int = 65536,
    ) -> None:
        if not WRITER_RE.match(writer):
            raise TokenLedgerError(f"writer {writer!r} is not a key segment ({WRITER_RE.pattern})")
        if slots < 1:
            raise TokenLedgerError(f"slots must be at least 1, got {slots}")
        self.registry = registry
        self.writer = writer
        self.price = price
        self.clock: Clock = clock or SystemClock()
        self.flush_s = flush_s
        self.path = Path(state_dir) / FILE_NAME
        self._queue: list[_Pending] = []
        # (day, tenant, model, site, client region) -> the row's sums since the last flush
        self._rows: dict[tuple[str, str, str, str, str], _Pending] = {}
        self._in_flight = 0
        # TokenDay key -> the day as this ledger last committed it, and its bytes: the next
        # flush starts from it, guarded on the key still holding exactly those bytes
        self._written: dict[str, tuple[TokenDay, bytes]] = {}
        self._flush_lock = asyncio.Lock()
        self._warned_memory = False
        self._after_commit: Callable[[], None] | None = None  # tests: a crash before the free
        self._fd = -1
        self.mapped: mmap.mmap | None = None
        mm, self.slots, self._seq = self._map(slots)
        # the same file as int64 words (every counter is 8-aligned): the gateway's Meter
        # stores a stream's delivered count through it (Ticket.words); released on close
        self.words: memoryview | None = memoryview(mm).cast("q")
        # the file as the gateway's compiled accounting writes it (routing.gateway.tally):
        # rows' sums and streams' slots, with the free slots (one list, shared)
        self.file = SlotFile(
            self.words, memoryview(mm).cast("d"), memoryview(mm), [], _HEADER_SIZE, SLOT_SIZE
        )
        states = mm[_HEADER_SIZE : _HEADER_SIZE + self.slots * SLOT_SIZE : SLOT_SIZE]
        # low slots first, so the pages a quiet broker touches stay few
        self._free: list[int] = [i for i in range(self.slots - 1, -1, -1) if states[i] == FREE]
        self.file.free = self._free
        self._unrecovered: list[int] = [i for i in range(self.slots) if states[i] != FREE]

    # -- the file ----------------------------------------------------------------------------

    def _map(self, slots: int) -> tuple[mmap.mmap, int, int]:
        """Open (or make) the file, lock it, map it; (the map, its slots, its flush seq)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise TokenLedgerError(f"{self.path} is held by another process") from exc
            size = os.fstat(fd).st_size
            if size == 0:
                os.ftruncate(fd, _HEADER_SIZE + slots * SLOT_SIZE)  # sparse: pages on use
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                header = (_MAGIC, _VERSION, SLOT_SIZE, slots, 0, 0, self.writer.encode())
                _HEADER.pack_into(mm, 0, *header)
                seq = 0
            else:
                if size < _HEADER_SIZE:
                    raise TokenLedgerError(f"{self.path} is not a token ledger (too short)")
                mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                magic, version, slot_size, slots, _, seq, writer = _HEADER.unpack_from(mm, 0)
                if magic != _MAGIC or version != _VERSION or slot_size != SLOT_SIZE:
                    mm.close()
                    raise TokenLedgerError(f"{self.path} is not a version {_VERSION} ledger")
                if _decode(writer) != self.writer:
                    mm.close()
                    raise TokenLedgerError(
                        f"{self.path} holds writer {_decode(writer)!r}'s tokens, not "
                        f"{self.writer!r}'s: pass TokenLedger.writer_id(state_dir)"
                    )
                if size < _HEADER_SIZE + slots * SLOT_SIZE:
                    mm.close()
                    raise TokenLedgerError(f"{self.path} is shorter than its {slots} slots")
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.mapped = fd, mm
        return mm, slots, seq

    @classmethod
    def writer_id(cls, state_dir: Path) -> str:
        """This state_dir's writer: made once (host name and random), kept in the directory, so
        a restarted broker writes, and recovers, its own TokenDay keys."""
        path = Path(state_dir) / WRITER_FILE
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            pass
        else:
            if not WRITER_RE.match(text):
                raise TokenLedgerError(f"{path} holds {text!r}, not a writer id")
            return text
        host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-")[:40]
        made = f"{host or 'broker'}-{secrets.token_hex(4)}"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(made + "\n")
        try:
            os.link(tmp, path)  # atomic, and never replaces one another process just made
        except FileExistsError:
            return cls.writer_id(state_dir)
        finally:
            tmp.unlink()
        return made

    def slot_offset(self, slot: int) -> int:
        return _HEADER_SIZE + slot * SLOT_SIZE

    def now(self) -> float:
        return self.clock.time()

    def _warn_memory(self, why: str) -> None:
        if not self._warned_memory:
            self._warned_memory = True
            log.warning("token ledger: %s; such uses are kept in memory only", why)

    def _claim(self, use: TokenUse, state: int, delivered: int, usd: float) -> int:
        """A slot holding `use` in `state` (its fields written before the state byte), or -1."""
        mm = self.mapped
        if mm is None:
            self._warn_memory("settled after close")
            return -1
        names = _names(use)
        if names is None:
            for name, size in _STRINGS[1:]:
                value = getattr(use, name)
                if _encode(value or "", size) is None:
                    self._warn_memory(f"{name} {value!r} is longer than {size} bytes or holds NUL")
            return -1
        if not self._free:
            self._warn_memory(f"all {self.slots} slots are taken")
            return -1
        slot = self._free.pop()
        flags = (_COUNTED if use.counted else 0) | (_HAS_TOKEN if use.token_id else 0)
        off = self.slot_offset(slot)
        _SLOT.pack_into(
            mm,
            off,
            FREE,
            flags,
            use.at,
            delivered,
            use.prompt_tokens,
            use.prompt_tokens,
            use.completion_tokens,
            use.cached_tokens,
            use.at,
            usd,
            0,
            _cut(use.request_id, _STRINGS[0][1]),
            *names,
        )
        mm[off] = state
        return slot

    # -- the gateway's calls -----------------------------------------------------------------

    def open(
        self,
        *,
        request_id: str,
        tenant: str,
        token_id: str | None,
        requested: str,
        service: str,
        model: str,
        site: str,
        client_region: str,
        prompt_tokens: int,
    ) -> Ticket:
        """Write a stream ahead, before its first byte reaches the client."""
        opened = TokenUse(
            request_id=request_id,
            tenant=tenant,
            token_id=token_id,
            model=model,
            requested=requested,
            service=service,
            site=site,
            client_region=client_region,
            prompt_tokens=_count(prompt_tokens),
            completion_tokens=0,
            cached_tokens=0,
            at=self.now(),
        )
        return Ticket(self, self._claim(opened, OPEN, 0, 0.0), opened)

    def settle(self, use: TokenUse) -> float:
        """A whole answer's use: written ahead and queued; its USD. Counts are clamped."""
        if not _sane(use):
            use = _clamped(use, self.now())
        usd = self._usd(use)
        self._add(use, usd)
        return usd

    def row(self, use: TokenUse) -> Row:
        """The live row `use` goes into: the sums of its day, tenant, model, site and client
        region since the last flush, in one slot claimed by the row's first use (between two
        flushes one slot and one queued item per row, however many requests). The gateway's
        compiled accounting adds to it (routing.gateway.tally) until a flush takes it."""
        key = (token_day(use.at), use.tenant, use.model, use.site, use.client_region)
        item = self._rows.get(key)
        if item is not None and item.row is not None:
            return item.row
        slot = self._claim(use, ROW, 0, 0.0)
        word = (self.slot_offset(slot) + _DELIVERED_AT) // _SEQ.size if slot >= 0 else -1
        row = Row(self.file, word)
        item = _Pending(use, 0.0, slot, 0, 0, row=row)
        self._rows[key] = item
        self._queue.append(item)
        return row

    def template(self, use: TokenUse) -> bytes | None:
        """An open stream's slot for `use`'s names as the gateway copies it (its state byte
        free, no request id, no counts: routing.gateway.tally.Tally.open writes those); None
        when a name does not fit a slot."""
        names = _names(use)
        if names is None:
            return None
        flags = _HAS_TOKEN if use.token_id else 0
        return _SLOT.pack(FREE, flags, 0.0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, b"", *names)

    def _add(self, use: TokenUse, usd: float) -> None:
        """Add a settled use to its row's sums (`row`), stored into the row's slot."""
        self.row(use).add(
            use.prompt_tokens, use.completion_tokens, use.cached_tokens, use.counted, usd, use.at
        )

    def _take_rows(self, batch: list[_Pending]) -> None:
        """A flush takes the live rows: their sums into their queued items, and what settles
        from now on goes into new rows (the gateway's accounts see `live` False)."""
        for item in batch:
            row = item.row
            if row is None:
                continue
            row.live = False
            item.row = None
            item.requests, item.counted = row.requests, row.counted
            item.prompt, item.completion, item.cached = row.prompt, row.completion, row.cached
            item.usd = row.usd

    def settle_slot(self, slot: int, use: TokenUse) -> float:
        """A ticket's end: its numbers into its row (Ticket.settle), then its slot freed (a
        kill between the two, a few instructions, would bill the stream twice, never lose
        it)."""
        usd = self._usd(use)
        self._add(use, usd)
        self.free_slot(slot)
        return usd

    def free_slot(self, slot: int) -> None:
        mm = self.mapped
        if slot >= 0 and mm is not None:
            mm[self.slot_offset(slot)] = FREE
            self._free.append(slot)

    def price_of(self, use: TokenUse) -> TokenPrice | None:
        """`use`'s price (None: free, or the lookup failed, which is logged)."""
        try:
            return self.price(use.site, use.model, use.at)
        except Exception:  # a price lookup's bug must not cost the settlement itself
            log.exception("token ledger: no price for %s at %s", use.model, use.site)
            return None

    def _usd(self, use: TokenUse) -> float:
        usd = cost_usd(use, self.price_of(use))
        return usd if math.isfinite(usd) and usd > 0 else 0.0

    def pending(self) -> int:
        """Settled uses not yet in etcd (recovered ones included)."""
        waiting = self._in_flight + sum(
            item.requests if item.row is None else item.row.requests for item in self._queue
        )
        mm = self.mapped
        for slot in self._unrecovered:  # a row's slot holds many
            off = self.slot_offset(slot)
            if mm is not None and mm[off] == ROW:
                waiting += _count(_SEQ.unpack_from(mm, off + _DELIVERED_AT)[0])
            else:
                waiting += 1
        return waiting

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> int:
        """Queue what a previous process left in the file: a settled slot as it was, an open
        one settled with its prompt and delivered tokens (`counted=True`). Returns how many."""
        mm = self.mapped
        todo, self._unrecovered = self._unrecovered, []
        if mm is None:
            return 0
        queued = len(self._queue)
        for slot in todo:
            off = self.slot_offset(slot)
            fields = _SLOT.unpack_from(mm, off)
            state, flags, opened_at, delivered, prompt = fields[:5]
            final_prompt, final_completion, cached, at, usd, mark = fields[5:11]
            strings = zip(_STRINGS, fields[11:], strict=True)
            text = {name: _decode(raw) for (name, _), raw in strings}
            if state not in (OPEN, SETTLED, ROW):  # a torn or foreign byte: nothing to bill
                log.warning("token ledger: slot %d in unknown state %d freed", slot, state)
                self.free_slot(slot)
                continue
            if state == OPEN:  # what reached the client before the kill
                counts, when, counted = (_count(prompt), _count(delivered), 0), opened_at, True
            else:
                counts = (_count(final_prompt), _count(final_completion), _count(cached))
                when, counted = at, state == SETTLED and bool(flags & _COUNTED)
            single = state != ROW  # a row's names are its first use's; it holds many
            use = TokenUse(
                request_id=text["request_id"] if single else "",
                tenant=text["tenant"],
                token_id=text["token_id"] if single and flags & _HAS_TOKEN else None,
                model=text["model"],
                requested=text["requested"],
                service=text["service"],
                site=text["site"],
                client_region=text["client_region"],
                prompt_tokens=counts[0],
                completion_tokens=counts[1],
                cached_tokens=counts[2],
                at=when,
                counted=counted,
            )
            if state == OPEN:  # settled in place, so a second recovery finds it settled
                usd = self._usd(use)
                final = (use.prompt_tokens, use.completion_tokens, 0, use.at, usd, 0)
                _FINAL.pack_into(mm, off + _FINAL_AT, *final)
                mm[off + 1] = _COUNTED | (flags & _HAS_TOKEN)
                mm[off] = SETTLED
                mark = 0
            if state == ROW:  # a row's sums: `delivered` is its requests, `prompt` the counted
                self._queue.append(
                    _Pending(
                        use, usd, slot, max(mark, 0), _count(delivered), _count(prompt),
                        use.prompt_tokens, use.completion_tokens, use.cached_tokens,
                    )
                )  # fmt: skip
            else:
                self._queue.append(_Pending.one(use, usd, slot, max(mark, 0)))
        recovered = sum(item.requests for item in self._queue[queued:])
        if todo:
            log.info("token ledger: recovered %d uses from %s", recovered, self.path)
        return recovered

    # -- flushes -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Recover the file, then flush every flush_s; an etcd outage keeps the uses and backs
        off (logged once per outage). Supervise it: a bug here surfaces, it is not swallowed."""
        self.recover()
        delay = 0.0
        outage = False
        while True:
            await self.clock.sleep(delay)
            try:
                await self.flush()
            except (RegistryError, StaleRecord, TokenLedgerError) as exc:
                if not outage:
                    log.warning("token ledger: flush failed, retrying with backoff: %s", exc)
                    outage = True
                delay = min(max(delay * 2, self.flush_s), MAX_BACKOFF_S)
                continue
            if outage:
                log.info("token ledger: flushing again (%d pending)", self.pending())
                outage = False
            delay = self.flush_s

    async def close(self) -> None:
        """A last flush (what fails stays in the file for the next start), then unmap."""
        try:
            await self.flush()
        except (RegistryError, StaleRecord, TokenLedgerError) as exc:
            log.warning("token ledger: last flush failed, kept in %s: %s", self.path, exc)
        finally:
            mm, self.mapped = self.mapped, None
            words, self.words = self.words, None
            self.file.release()  # the gateway's stores into it after this stop (ValueError)
            if words is not None:
                words.release()  # a Meter storing into it after this stops (ValueError)
            if mm is not None:
                mm.flush()
                mm.close()
            if self._fd >= 0:
                os.close(self._fd)  # releases the lock
                self._fd = -1

    async def flush(self) -> int:
        """Write everything queued into etcd; how many uses it settled (or found settled).
        Raises RegistryError (etcd away) with the uses kept for the next flush."""
        async with self._flush_lock:
            if not self._queue:
                return 0
            batch, self._queue = self._queue, []
            self._rows = {}  # what settles from now on goes into new rows, for the next flush
            self._take_rows(batch)
            self._in_flight = sum(item.requests for item in batch)
            groups: dict[str, list[_Pending]] = {}
            for item in batch:
                use = item.use
                key = keys.usage_tokens(token_day(use.at), use.tenant, self.writer)
                groups.setdefault(key, []).append(item)
            done = 0
            try:
                names = list(groups)
                for i in range(0, len(names), KEYS_PER_TXN):
                    chunk = names[i : i + KEYS_PER_TXN]
                    done += await self._commit(chunk, groups)
                    for key in chunk:
                        del groups[key]
            finally:
                self._queue[:0] = [item for items in groups.values() for item in items]
                self._in_flight = 0
            return done

    async def _commit(self, names: Sequence[str], groups: dict[str, list[_Pending]]) -> int:
        """One transaction for `names`' uses: read the keys, drop what is in already, add the
        rest under a new flush seq, commit guarded; again on a lost race."""
        done = 0
        for _ in range(MAX_ATTEMPTS):
            try:
                done += await self._attempt(names, groups)
            except _LostRace as lost:
                done += lost.done
                continue
            except BaseException:
                for key in names:  # the commit may have gone in: read them again
                    self._written.pop(key, None)
                raise
            return done
        raise StaleRecord(f"token ledger: {len(names)} TokenDay keys changed under every try")

    async def _attempt(self, names: Sequence[str], groups: dict[str, list[_Pending]]) -> int:
        """One try of `_commit`: the keys as this ledger last wrote them (guarded on holding
        exactly that: it is their only writer, so a flush reads them only after a start or a
        failed try), else read; _LostRace when a guard failed."""
        done = 0
        written = {key: self._written[key] for key in names if key in self._written}
        unknown = [key for key in names if key not in written]
        got = await self.registry.get_many(unknown) if unknown else {}
        days: dict[str, tuple[TokenDay, Guard]] = {}
        for key in names:
            if key in written:
                day, value = written[key]
                guard = Guard(key, value=value)
            else:
                day = self._day(key, got.get(key), groups[key][0].use)
                guard = Guard(key, mod_revision=got[key][1] if key in got else 0)
            live = []
            for item in groups[key]:
                if 0 < item.mark <= day.seq:
                    self._free_item(item)  # an earlier flush of it committed
                    done += item.requests
                else:
                    live.append(item)
            groups[key] = live
            if live:
                days[key] = (day, guard)
        if not days:
            return done
        seq = max(self._seq, *(day.seq for day, _ in days.values())) + 1
        self._set_seq(seq)
        puts: dict[str, bytes] = {}
        for key, (day, _) in days.items():
            # sums per row in plain numbers first: one model update per row, not per use
            sums: dict[str, list[float]] = {}
            for item in groups[key]:
                if item.mark == 0:
                    self._mark(item, seq)
                use = item.use
                name = row_key(use.model, use.site, use.client_region)
                tally = sums.get(name)
                if tally is None:
                    tally = sums[name] = [0, 0, 0, 0, 0, 0.0]
                tally[0] += item.requests
                tally[1] += item.prompt
                tally[2] += item.completion
                tally[3] += item.cached
                tally[4] += item.counted
                tally[5] += item.usd
            for name, (n, prompt, completion, cached, counted, usd) in sums.items():
                row = day.rows.get(name)
                if row is None:
                    row = day.rows[name] = TokenRow()
                row.requests += int(n)
                row.prompt_tokens += int(prompt)
                row.completion_tokens += int(completion)
                row.cached_tokens += int(cached)
                row.counted_requests += int(counted)
                row.usd += usd
            day.seq = seq
            puts[key] = day.model_dump_json().encode()
        guards = [guard for _, guard in days.values()]
        if not await self.registry.commit(guards=guards, puts=puts):
            for key in days:  # changed by another (a misconfigured twin): read them again
                self._written.pop(key, None)
            raise _LostRace(done)
        if len(self._written) >= _WRITTEN_MAX:
            self._written.clear()
        for key, (day, _) in days.items():
            self._written[key] = (day, puts[key])
        if self._after_commit is not None:
            self._after_commit()
        for key in days:
            for item in groups[key]:
                self._free_item(item)
                done += item.requests
            groups[key] = []
        return done

    def _day(self, key: str, raw: tuple[bytes, int] | None, use: TokenUse) -> TokenDay:
        if raw is None:
            return TokenDay(day=token_day(use.at), tenant=use.tenant, writer=self.writer)
        try:
            return TokenDay.model_validate_json(raw[0])
        except ValidationError as exc:
            raise TokenLedgerError(f"{key} does not hold a TokenDay: {exc}") from exc

    def _set_seq(self, seq: int) -> None:
        self._seq = seq
        if self.mapped is not None:
            _SEQ.pack_into(self.mapped, _SEQ_AT, seq)

    def _mark(self, item: _Pending, seq: int) -> None:
        item.mark = seq
        if item.slot >= 0 and self.mapped is not None:
            _SEQ.pack_into(self.mapped, self.slot_offset(item.slot) + _MARK_AT, seq)

    def _free_item(self, item: _Pending) -> None:
        slot, item.slot = item.slot, -1
        self.free_slot(slot)
