"""Stand-in model servers (routing.standin.server) as real subprocesses on loopback, for tests."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from tests.conftest import REPO


class StandIns:
    """Starts `python -m routing.standin.server` processes; stop() ends each one it started."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, name: str, *args: str) -> str:
        """Its base URL once it listens. `args`: more CLI flags (--median-ms etc. default 50)."""
        flags = dict(zip(args[::2], args[1::2], strict=True))
        for flag, value in (("--median-ms", "50"), ("--p99-ms", "50"), ("--max-concurrency", "4")):
            flags.setdefault(flag, value)
        argv = [x for kv in flags.items() for x in kv]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:0",
            "--name", name, *argv,
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        return line.removeprefix("listening on ")

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def standins() -> AsyncIterator[StandIns]:
    servers = StandIns()
    yield servers
    await servers.stop()
