"""broker.state.auth.TokenBook's check of an Authorization header, and what it remembers of one.

The book is fed the registry's events as its watch would (`_event`); the e2e tests in
test_auth.py check expiry and revocation through real brokers. Last use is recorded against the
session's etcd."""

from __future__ import annotations

import asyncio

import pytest

from broker.state.auth import (
    ANONYMOUS,
    CHECKED_TOKENS,
    Role,
    TokenBook,
    TokenRecord,
    Unauthorized,
    create_token,
    new_token,
)
from sites.model import keys
from sites.registry.client import Registry
from tests.conftest import wait_for


def _book() -> TokenBook:
    # the registry is never called: the watch's events are fed by hand
    return TokenBook(registry=Registry.__new__(Registry))


def _add(book: TokenBook, role: Role, **kw: object) -> tuple[str, str]:
    record, token = new_token(role=role, tenant=None, now=100.0, created_by="etcd", **kw)  # type: ignore[arg-type]
    book._event(keys.token(record.id), record.model_dump_json().encode(), 1)  # noqa: SLF001
    return record.id, f"Bearer {token}"


def test_a_checked_header_is_refused_once_revoked_replaced_or_expired() -> None:
    book = _book()
    token_id, header = _add(book, Role.viewer, ttl_s=50)
    assert book.authenticate(header, 110.0).role is Role.viewer
    assert book.authenticate(header, 120.0).role is Role.viewer  # remembered
    with pytest.raises(Unauthorized, match="expired"):
        book.authenticate(header, 150.0)
    # a wrong secret for a known id is never taken for the remembered header
    wrong = header[:-4] + ("AAAA" if not header.endswith("AAAA") else "BBBB")
    with pytest.raises(Unauthorized, match="unknown or revoked"):
        book.authenticate(wrong, 110.0)
    # the record replaced (here: another role): checked against the new one
    record = book.tokens[token_id].model_copy(update={"role": Role.admin, "expires_at": None})
    book._event(keys.token(token_id), record.model_dump_json().encode(), 2)  # noqa: SLF001
    assert book.authenticate(header, 200.0).role is Role.admin
    book._event(keys.token(token_id), None, 3)  # noqa: SLF001 - revoked
    with pytest.raises(Unauthorized, match="unknown or revoked"):
        book.authenticate(header, 200.0)


def test_what_it_remembers_is_bounded() -> None:
    book = _book()
    headers = [_add(book, Role.viewer)[1] for _ in range(CHECKED_TOKENS + 5)]
    for header in headers:
        book.authenticate(header, 110.0)
    assert len(book._checked) <= CHECKED_TOKENS  # noqa: SLF001
    assert all(book.authenticate(h, 110.0).role is Role.viewer for h in headers[:3])


async def test_last_use_is_written_once_a_minute_and_never_revives_a_revoked_token(
    registry: Registry,
) -> None:
    """Against the session's etcd, the book followed by its own watch."""
    book = TokenBook(registry=registry)
    mirror = asyncio.create_task(book.mirror.run(), name="token mirror")
    try:
        (a, token_a), (b, token_b) = (
            new_token(role=Role.viewer, tenant=None, now=100.0, created_by="etcd") for _ in range(2)
        )
        for record in (a, b):
            await create_token(registry, record)
        await wait_for(lambda: a.id in book.tokens and b.id in book.tokens, 10)
        for at in (100.0, 110.0, 130.0):  # three requests: one write, of the latest
            book.authenticate(f"Bearer {token_a}", at)
        book.authenticate(f"Bearer {token_b}", 120.0)
        await registry.commit(
            guards=[], deletes=[keys.token(b.id)]
        )  # revoked before its use is written
        assert await book.record_use() == 1
        stored = await registry.get_raw(keys.token(a.id))
        assert stored is not None
        assert TokenRecord.model_validate_json(stored[0]).last_used_at == 130.0
        assert await registry.get_raw(keys.token(b.id)) is None  # not written back
        await wait_for(lambda: book.tokens[a.id].last_used_at == 130.0, 10)
        book.authenticate(f"Bearer {token_a}", 150.0)  # within a minute of the stored use
        assert await book.record_use() == 0
        book.authenticate(f"Bearer {token_a}", 200.0)
        assert await book.record_use() == 1
        assert book.get(ANONYMOUS, a.id).public()["last_used_at"] in (130.0, 200.0)
    finally:
        mirror.cancel()
        await asyncio.gather(mirror, return_exceptions=True)


def test_stale_tokens_are_those_unused_for_the_duration() -> None:
    from cpn.token_cli import stale_tokens

    day = 86400.0
    tokens = [
        {"id": "used-lately", "created_at": 0.0, "last_used_at": 95 * day},
        {"id": "used-long-ago", "created_at": 0.0, "last_used_at": 5 * day},
        {"id": "never-used-old", "created_at": 1 * day, "last_used_at": None},
        {"id": "never-used-new", "created_at": 99 * day},
    ]
    stale = stale_tokens(tokens, now=100 * day, older_than_s=90 * day)
    assert [t["id"] for t in stale] == ["used-long-ago", "never-used-old"]
