"""Privileged probes: ICMP echo over a raw socket, and TCP SYN/SYN-ACK timing with scapy.

`echo_rtt_ms` sends one echo request on a raw ICMP socket (root, or CAP_NET_RAW) and waits on
the event loop for its reply: the kernel hands such a socket only ICMP, so a busy link costs
the probe nothing. (It used scapy's sr1 until 2026-12-06, whose sniffer parsed every packet on
the interface in Python for the length of each probe: on a busy host it fell behind and lost
replies that had arrived.)

`tcp_syn_rtt_ms` still uses scapy (the only module that imports it); it blocks, so callers run
it in a thread.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import struct
import time
from typing import Any

_seq = itertools.count(1)
_ECHO_REQUEST, _ECHO_REPLY = 8, 0
_PAYLOAD = bytes(range(48))  # with the 8-byte header, ping's 56 bytes of ICMP data


def available() -> bool:
    """Can this process send ICMP echo on a raw socket (the `icmp` method)?"""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
    except OSError:
        return False
    return True


def scapy_available() -> bool:
    """Can this process time TCP SYN/SYN-ACK with scapy (the `tcp-syn` method)?"""
    if os.geteuid() != 0:
        return False
    try:
        import scapy.all  # noqa: F401
    except Exception:  # noqa: BLE001 - scapy may fail to import for many platform reasons
        return False
    return True


def _checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    """An ICMP echo request (type 8) with its checksum."""
    header = struct.pack("!BBHHH", _ECHO_REQUEST, 0, 0, ident, seq)
    checksum = _checksum(header + _PAYLOAD)
    return struct.pack("!BBHHH", _ECHO_REQUEST, 0, checksum, ident, seq) + _PAYLOAD


def _is_reply(packet: bytes, ident: int, seq: int) -> bool:
    """Is this IPv4 packet (as a raw socket reads it, IP header first) our echo's reply?"""
    if not packet:
        return False
    start = (packet[0] & 0x0F) * 4
    if len(packet) < start + 8:
        return False
    kind, _, _, got_ident, got_seq = struct.unpack_from("!BBHHH", packet, start)
    return bool(kind == _ECHO_REPLY and got_ident == ident and got_seq == seq)


async def echo_rtt_ms(host: str, source: str | None = None) -> float:
    """Milliseconds from one echo request to `host` (IPv4) to its reply, read on the running
    loop; waits until it comes (the caller bounds the wait, and cancels it). OSError when the
    socket cannot be made or the request cannot be sent."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_DGRAM)
    address = infos[0][4][0]
    # the id tells this process's echoes from others' (each raw socket sees every reply),
    # the sequence number this probe's from the ones in flight beside it
    ident, seq = os.getpid() & 0xFFFF, next(_seq) & 0xFFFF
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.setblocking(False)
        if source:
            sock.bind((source, 0))
        answered: asyncio.Future[float] = loop.create_future()

        def readable() -> None:
            while not answered.done():
                try:
                    packet, peer = sock.recvfrom(65535)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    answered.set_exception(exc)
                    return
                if peer[0] == address and _is_reply(packet, ident, seq):
                    answered.set_result(time.perf_counter())

        loop.add_reader(sock.fileno(), readable)
        try:
            sent = time.perf_counter()
            sock.sendto(echo_request(ident, seq), (address, 0))
            return (await answered - sent) * 1000.0
        finally:
            loop.remove_reader(sock.fileno())


def _scapy(host: str) -> Any:
    import scapy.all as sc

    sc.conf.verb = 0
    if host.startswith("127.") or host == "localhost":
        # loopback needs a raw L3 socket: the default L2 socket never sees the reply
        sc.conf.L3socket = sc.L3RawSocket
    return sc


def tcp_syn_rtt_ms(host: str, port: int, timeout_s: float) -> float | None:
    sc = _scapy(host)
    request = sc.IP(dst=host) / sc.TCP(dport=port, sport=sc.RandShort(), flags="S")
    reply = sc.sr1(request, timeout=timeout_s)
    if reply is None or not reply.haslayer(sc.TCP):
        return None
    return float(reply.time - request.sent_time) * 1000.0
