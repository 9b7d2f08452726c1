"""broker.state.auth.TokenBook's check of an Authorization header, and what it remembers of one.

The book is fed the registry's events as its watch would (`_event`); the e2e tests in
test_auth.py check expiry and revocation through real brokers."""

from __future__ import annotations

import pytest

from broker.state.auth import CHECKED_TOKENS, Role, TokenBook, Unauthorized, new_token
from sites.model import keys
from sites.registry.client import Registry


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
