"""systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram to
$NOTIFY_SOCKET per message. A unit with ``Type=notify`` waits for ``READY=1`` before it counts
the agent or the broker as started (configs/systemd/, docs/operations.md); ``STOPPING=1`` says a
stop has begun; with ``WatchdogSec=`` set, systemd passes $WATCHDOG_USEC and restarts the
process when ``WATCHDOG=1`` stops coming (here: from the event loop, so a loop that hangs is
restarted). Outside systemd (no $NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

__all__ = ["notify", "watchdog_interval_s", "watchdog_loop"]

log = logging.getLogger(__name__)


def _address(value: str) -> str | bytes:
    # "@name" is a socket in the abstract namespace: a leading NUL byte on the wire
    return b"\0" + value[1:].encode() if value.startswith("@") else value


def notify(*lines: str) -> bool:
    """Send ``lines`` (e.g. "READY=1", "STATUS=...") as one message; False when there is no
    $NOTIFY_SOCKET or the send failed (logged: a supervisor that cannot be told is no reason
    to stop serving)."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto("\n".join(lines).encode(), _address(target))
    except OSError as exc:
        log.warning("sd_notify to %s: %s", target, exc)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1: half of $WATCHDOG_USEC (as sd_watchdog_enabled(3)
    advises), when it is set for this very process ($WATCHDOG_PID, if present, is ours)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


async def watchdog_loop(interval_s: float) -> None:
    """WATCHDOG=1 every ``interval_s`` from the event loop until cancelled."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
