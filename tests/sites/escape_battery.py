"""The escape battery: run *inside* a tenant's job, it tries what an attacker would.

Usage (as a job's command): python3 escape_battery.py '<json>' where the JSON names the targets
from the host's side: {"agent_uid": int, "agent_pids": [int], "other_pids": [int],
"secrets": [paths the job must not read], "dirs": [dirs it must not list, or [dir,
[names it may see there]]],
"write": [paths it must not create], "marker": a string no variable may hold,
"connect": [[host, port], ...] it must not reach}. It prints one line per check,
``OK <name>: <detail>`` or ``ESCAPED <name>: <detail>``, then ``DONE <n>``; the tests assert
from these lines, so a check that cannot run prints ESCAPED rather than nothing.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    n = 0

    def say(ok: bool, name: str, detail: str) -> None:
        nonlocal n
        n += 1
        print(f"{'OK' if ok else 'ESCAPED'} {name}: {detail}", flush=True)

    uid = os.getuid()
    say(uid != 0 and os.geteuid() != 0, "not-root", f"uid {uid} euid {os.geteuid()}")
    say(uid != spec["agent_uid"] or spec["agent_uid"] != 0, "not-agent", f"uid {uid}")
    say(not os.getgroups() or 0 not in os.getgroups(), "no-root-group", str(os.getgroups()))
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (ln.partition(":") for ln in f) if k.startswith("Cap")}
    say(int(caps.get("CapEff", "0"), 16) == 0, "no-capabilities", caps.get("CapEff", "?"))

    marker = spec.get("marker", "")
    leaked = sorted(
        k
        for k, v in os.environ.items()
        if (marker and marker in v)
        or k.startswith(("ETCD", "CPN_ETCD", "CPN_TOKEN", "CPN_CONFIG", "CPN_STATE", "CPN_PKI"))
        or k in ("CPN_AGENT_SECRET", "SSH_AUTH_SOCK")
    )
    say(not leaked, "environment", f"leaked {leaked}" if leaked else f"{len(os.environ)} vars")

    for path in spec.get("secrets", []):
        try:
            with open(path, "rb") as f:
                data = f.read(64)
            # an empty read is /dev/null mounted over it: nothing of it shows
            say(not data, "read", f"{path}: read {data[:20]!r}")
        except OSError as exc:
            say(True, "read", f"{path}: {exc.strerror}")
    for entry in spec.get("dirs", []):
        # [path, [names it may see there]]: the directories above its own work dir
        path, allowed = (entry, []) if isinstance(entry, str) else entry
        try:
            names = os.listdir(path)
            say(set(names) <= set(allowed), "list", f"{path}: {names[:5]}")
        except OSError as exc:
            say(True, "list", f"{path}: {exc.strerror}")
    for path in spec.get("write", []):
        try:
            with open(path, "w") as f:
                f.write("pwned")
            say(False, "write", f"{path}: written")
        except OSError as exc:
            say(True, "write", f"{path}: {exc.strerror}")

    # processes: the agent's and other jobs' pids (host pids) cannot be signalled; and what the
    # job sees of /proc is its own
    for pid in [*spec.get("agent_pids", []), *spec.get("other_pids", [])]:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/status") as f:
                owner = next(ln for ln in f if ln.startswith("Uid:")).split()[1]
            say(int(owner) == uid, "signal", f"pid {pid} is visible (uid {owner})")
        except (ProcessLookupError, PermissionError, FileNotFoundError) as exc:
            say(True, "signal", f"pid {pid}: {type(exc).__name__}")
    try:
        os.kill(1, 0)  # pid 1 of its namespace: the sandbox's init, root's (0: permission only)
        with open("/proc/1/status") as f:
            owner = next(ln for ln in f if ln.startswith("Uid:")).split()[1]
        say(int(owner) == uid, "signal-init", f"pid 1 may be signalled (uid {owner})")
    except (PermissionError, ProcessLookupError) as exc:
        say(True, "signal-init", type(exc).__name__)
    seen = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    foreign = []
    for pid in seen:
        try:
            with open(f"/proc/{pid}/status") as f:
                owner = next(ln for ln in f if ln.startswith("Uid:")).split()[1]
        except (OSError, StopIteration):
            continue
        if int(owner) != uid and pid != 1:
            foreign.append(pid)
    say(not foreign, "process-view", f"{len(seen)} processes, foreign {foreign[:5]}")

    for host, port in spec.get("connect", []):
        try:
            with socket.create_connection((host, port), timeout=2):
                say(False, "connect", f"{host}:{port} reached")
        except OSError as exc:
            say(True, "connect", f"{host}:{port}: {exc.strerror or exc}")
    print(f"DONE {n}", flush=True)


def checks(output: str) -> list[str]:
    """The battery's check lines in a job's output (the tests' side); AssertionError when the
    battery did not run to its end (a check that could not run must not pass unseen)."""
    lines = [ln for ln in output.splitlines() if ln.startswith(("OK ", "ESCAPED ", "DONE "))]
    if (
        not lines
        or not lines[-1].startswith("DONE ")
        or int(lines[-1].split()[1]) != len(lines) - 1
    ):
        raise AssertionError(f"the escape battery did not finish:\n{output}")
    return lines[:-1]


def escapes(output: str) -> list[str]:
    """The checks in ``output`` that escaped (none, for a confined job)."""
    return [ln for ln in checks(output) if ln.startswith("ESCAPED")]


if __name__ == "__main__":
    main()
