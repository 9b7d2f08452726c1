"""The suite's own guards work: a leaked asyncio task fails the test that leaked it."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import check_no_pending_tasks


async def test_a_leaked_task_fails_the_test_and_is_cancelled() -> None:
    before = asyncio.all_tasks()
    leaked = asyncio.create_task(asyncio.Event().wait(), name="leaked-on-purpose")
    with pytest.raises(pytest.fail.Exception, match="1 asyncio task.*leaked-on-purpose"):
        await check_no_pending_tasks(before, grace_s=0.05)
    assert leaked.cancelled()


async def test_a_task_that_finishes_within_the_grace_is_fine() -> None:
    before = asyncio.all_tasks()
    asyncio.create_task(asyncio.sleep(0.01), name="finishes")
    await check_no_pending_tasks(before, grace_s=1.0)
