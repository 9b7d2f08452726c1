"""Privileged probes with scapy: ICMP echo and TCP SYN/SYN-ACK timing (root only).

The only module that imports scapy. Calls block (scapy sends and sniffs), so callers run them
in a thread.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

_seq = itertools.count(1)


def available() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        import scapy.all  # noqa: F401
    except Exception:  # noqa: BLE001 - scapy may fail to import for many platform reasons
        return False
    return True


def _scapy(host: str) -> Any:
    import scapy.all as sc

    sc.conf.verb = 0
    if host.startswith("127.") or host == "localhost":
        # loopback needs a raw L3 socket: the default L2 socket never sees the reply
        sc.conf.L3socket = sc.L3RawSocket
    return sc


def icmp_rtt_ms(host: str, timeout_s: float) -> float | None:
    sc = _scapy(host)
    seq = next(_seq) & 0xFFFF
    request = sc.IP(dst=host) / sc.ICMP(id=os.getpid() & 0xFFFF, seq=seq)
    reply = sc.sr1(request, timeout=timeout_s)
    if reply is None:
        return None
    return float(reply.time - request.sent_time) * 1000.0


def tcp_syn_rtt_ms(host: str, port: int, timeout_s: float) -> float | None:
    sc = _scapy(host)
    request = sc.IP(dst=host) / sc.TCP(dport=port, sport=sc.RandShort(), flags="S")
    reply = sc.sr1(request, timeout=timeout_s)
    if reply is None or not reply.haslayer(sc.TCP):
        return None
    return float(reply.time - request.sent_time) * 1000.0
