"""A broker's start waits for etcd through an election or a member's loss (until_answered):
it used to exit on its first transaction's deadline."""

from __future__ import annotations

import asyncio

import pytest

from broker.process import until_answered
from sites.model.errors import RegistryError, RegistryUnavailable


def test_a_call_etcd_does_not_answer_yet_is_tried_again_until_it_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tries: list[int] = []

    async def call() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise RegistryUnavailable("etcd at http://127.0.0.1:1 is unavailable: no leader")
        return "seeded"

    assert asyncio.run(until_answered("seeding the tenancy", call)) == "seeded"
    assert len(tries) == 3
    warned = [r.getMessage() for r in caplog.records if "seeding the tenancy" in r.getMessage()]
    assert len(warned) == 2 and "no leader" in warned[0] and "trying again" in warned[0]


def test_etcd_that_never_answers_still_ends_in_its_error() -> None:
    async def call() -> None:
        raise RegistryUnavailable("etcd at http://127.0.0.1:1 is unavailable: refused")

    with pytest.raises(RegistryUnavailable, match="refused"):
        asyncio.run(until_answered("connecting to etcd", call, within_s=0.6))


def test_an_answer_that_is_a_refusal_is_not_tried_again() -> None:
    tries: list[int] = []

    async def call() -> None:
        tries.append(1)
        raise RegistryError("etcd request failed: permission denied")

    with pytest.raises(RegistryError):
        asyncio.run(until_answered("seeding the tenancy", call))
    assert tries == [1]
