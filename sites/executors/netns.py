"""User-mode networking for a sandboxed run under the site's ``network: egress`` policy.

The run gets its own network namespace (bubblewrap's --unshare-net) and slirp4netns, a
user-mode NAT, gives it a route out: it reaches what the host reaches, except the host's own
loopback services (``--disable-host-loopback``: the agent, etcd, the broker). bubblewrap
writes the sandbox's pid to an info pipe and waits on a block pipe until the network is up,
so the job never runs without it. slirp4netns runs in the run's cgroup, with the agent as its
parent-death signal, and ends with the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sites.executors.launcher import launcher
from sites.model.errors import SitesError

if TYPE_CHECKING:
    from sites.executors.confinement import ConfinedRun

__all__ = ["EgressError", "start_egress", "with_fds"]

READY_TIMEOUT_S = 10.0


class EgressError(SitesError):
    """The run's user-mode network could not be set up (the run is not started)."""


def with_fds(argv: Sequence[str], *, info_fd: int, block_fd: int) -> list[str]:
    """bubblewrap's argv with the info and block pipes (argv[0] is bwrap)."""
    return [argv[0], "--info-fd", str(info_fd), "--block-fd", str(block_fd), *argv[1:]]


def _read_info(fd: int) -> int:
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError):
            continue
    raise SitesError(f"bubblewrap gave no sandbox pid ({data!r})")


def _read_ready(fd: int) -> bytes:
    return os.read(fd, 1)


async def start_egress(info_r: int, block_w: int, run: ConfinedRun) -> asyncio.subprocess.Process:
    """Wait for the sandbox's pid, give its namespace slirp4netns, then let the run go."""
    slirp = shutil.which("slirp4netns")
    if slirp is None:
        raise EgressError("network egress: slirp4netns not found")
    try:
        pid = await asyncio.wait_for(asyncio.to_thread(_read_info, info_r), READY_TIMEOUT_S)
    except (TimeoutError, SitesError, OSError) as exc:
        raise EgressError(f"network egress: {exc}") from exc
    ready_r, ready_w = os.pipe()
    # in the run's memory, cpu and pids groups (it ends with them), not its devices group:
    # it opens /dev/net/tun, which the run may not
    procs = [p for p in (run.group.procs_files if run.group is not None else [])
             if "/devices/" not in p]  # fmt: skip
    try:
        net = await asyncio.create_subprocess_exec(
            *launcher(
                [
                    slirp,
                    "--configure",
                    "--mtu=65520",
                    "--disable-host-loopback",
                    "--enable-sandbox",
                    "--enable-seccomp",
                    f"--ready-fd={ready_w}",
                    str(pid),
                    "tap0",
                ],
                procs=procs,
            ),  # fmt: skip
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(ready_w,),
        )
    finally:
        os.close(ready_w)
    try:
        ready = await asyncio.wait_for(asyncio.to_thread(_read_ready, ready_r), READY_TIMEOUT_S)
    except TimeoutError:
        ready = b""
    finally:
        os.close(ready_r)
    if not ready:
        net.kill()
        _, err = await net.communicate()
        raise EgressError(f"network egress: slirp4netns failed: {err.decode().strip()[-200:]}")
    os.write(block_w, b"1")
    return net
