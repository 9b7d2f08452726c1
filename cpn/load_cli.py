"""`cpn load SERVICE`: a daily load that moves across client regions, sent through the broker's
gateway (cpn.load; docs/load.md). A progress line per region every `--every`, then a table:
sent, ok, errors, p50/p95/p99 time to first token, SLO attainment.

Bad input (an option out of range, a region with no known UTC offset, a service the broker does
not know) exits 2 with one line (cpn.load.LoadError is a ValueError; ApiError 4xx).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import signal
import ssl
import sys
from collections.abc import Callable
from typing import Any

from broker.model.regions import load_user_regions
from cpn.client import BrokerClient, certificate_authority, connection
from cpn.config import ConfigFileError
from cpn.load import LoadError, LoadReport, LoadSettings, LoadWindow, run_load
from simulations.service_demand import utc_offset_h_of
from sites.model.durations import parse_duration_s
from sites.model.errors import ConfigError

__all__ = ["add_parsers", "report_table"]


def _duration(option: str, value: str) -> float:
    try:
        return parse_duration_s(float(value) if value.replace(".", "", 1).isdigit() else value)
    except ValueError as exc:
        raise LoadError(f"{option}: {exc}") from None


def _offsets(text: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        region, sep, hours = part.partition("=")
        try:
            value = float(hours)
        except ValueError:
            value = math.nan  # refused below, with the other malformed parts
        if not sep or not region.strip() or not -12 <= value <= 14:
            raise LoadError(
                f"--utc-offset: {part.strip()!r} is not REGION=HOURS with HOURS in [-12, 14]"
            )
        out[region.strip()] = value
    return out


def _known_offsets() -> dict[str, float]:
    """Client region -> hours ahead of UTC from regions.yaml (longitude / 15), when it is
    there; the operator's machine may have no configs/ (then --utc-offset names them)."""
    try:
        regions = load_user_regions()
    except (ConfigError, ConfigFileError, OSError):
        return {}
    return {r: utc_offset_h_of(e.lon) for r, e in regions.items()}


def _ssl_context(url: str) -> ssl.SSLContext | bool:
    ca = certificate_authority(url)
    if not ca or not url.startswith("https://"):
        return True
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigFileError(f"CA file {ca}: {getattr(exc, 'strerror', None) or exc}") from None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _hhmm(hours: float) -> str:
    minutes = round(hours * 60) % (24 * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def window_lines(window: LoadWindow, report: LoadReport) -> list[str]:
    """A progress period's lines: one per region."""
    settings = report.settings
    lines = []
    for region in settings.regions:
        local = window.virtual_hour_utc + settings.utc_offset_h[region]
        lines.append(
            f"[{window.end_s:6.0f}s {_hhmm(window.virtual_hour_utc)} UTC] {region:<12} "
            f"local {_hhmm(local)}  target {window.target_rps[region]:6.2f}/s  "
            f"sent {window.sent[region]:>5}  ok {window.ok[region]:>5}  "
            f"errors {window.errors[region]:>4}  p95 {_ms(window.p95_ms[region])} ms"
        )
    return lines


def report_table(report: LoadReport) -> str:
    """The final table: one row per region."""
    rows = [("REGION", "SENT", "OK", "ERRORS", "P50-MS", "P95-MS", "P99-MS", "SLO-MS", "IN-SLO")]
    for region, s in report.regions.items():
        attained = s.attainment
        rows.append(
            (
                region,
                str(s.sent),
                str(s.ok),
                str(s.errors),
                _ms(s.percentile_ms(0.50)),
                _ms(s.percentile_ms(0.95)),
                _ms(s.percentile_ms(0.99)),
                _ms(s.slo_ms) if math.isfinite(s.slo_ms) else "-",
                "-" if attained is None else f"{100 * attained:.1f}%",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    kinds: dict[str, int] = {}
    for s in report.regions.values():
        for kind, n in s.error_kinds.items():
            kinds[kind] = kinds.get(kind, 0) + n
    if kinds:
        lines.append("errors: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    return "\n".join(lines)


def report_json(report: LoadReport) -> dict[str, Any]:
    return {
        "service": report.settings.service,
        "elapsed_s": round(report.elapsed_s, 3),
        "regions": {
            r: {
                "sent": s.sent,
                "ok": s.ok,
                "errors": s.errors,
                "error_kinds": s.error_kinds,
                "p50_ms": s.percentile_ms(0.50),
                "p95_ms": s.percentile_ms(0.95),
                "p99_ms": s.percentile_ms(0.99),
                "slo_ms": s.slo_ms if math.isfinite(s.slo_ms) else None,
                "slo_attainment": s.attainment,
            }
            for r, s in report.regions.items()
        },
        "windows": [
            {
                "start_s": w.start_s,
                "end_s": w.end_s,
                "virtual_hour_utc": round(w.virtual_hour_utc, 4),
                "sent": w.sent,
                "ok": w.ok,
                "errors": w.errors,
                "target_rps": {r: round(v, 4) for r, v in w.target_rps.items()},
            }
            for w in report.windows
        ],
    }


async def cmd_load(args: argparse.Namespace) -> int:
    day_s = _duration("--day", args.day)
    duration_s = _duration("--duration", args.duration) if args.duration else day_s
    every_s = _duration("--every", args.every)
    timeout_s = _duration("--timeout", args.timeout)
    given = _offsets(args.utc_offset)
    numbers = LoadSettings(  # the numbers checked before the broker is asked anything
        service=args.service,
        regions=(),
        utc_offset_h={},
        slo_ms={},
        peak_rps=args.peak_rps,
        day_s=day_s,
        duration_s=duration_s,
        start_hour_utc=args.start_hour,
        peak_local_hour=args.peak_hour,
        peak_to_trough=args.peak_to_trough,
        stream=args.stream,
        max_tokens=args.max_tokens,
        timeout_s=timeout_s,
        max_in_flight=args.max_in_flight,
        report_s=every_s,
        seed=args.seed,
    )
    url, token = connection(args.broker)
    async with BrokerClient.to(args.broker) as client:
        view = await client.call("GET", f"/v1/services/{args.service}")  # 404: exit 2
    spec = view["spec"]
    regions = tuple(r for r in (args.regions or "").split(",") if r) or tuple(spec["clients"])
    if not regions:
        raise LoadError(f"--regions: service {args.service!r} names no clients; give --regions")
    slo = spec["slo"]
    settings = dataclasses.replace(
        numbers,
        regions=regions,
        utc_offset_h={**_known_offsets(), **given},
        slo_ms={r: float(slo.get("regions", {}).get(r, slo["p95_ms"])) for r in regions},
    )
    table = args.output == "table"

    def progress(window: LoadWindow, report: LoadReport) -> None:
        for line in window_lines(window, report):
            print(line, file=sys.stdout if table else sys.stderr, flush=True)

    if table:
        print(
            f"load on {args.service}: {len(regions)} region(s), peak {settings.peak_rps:g} req/s "
            f"at {settings.peak_local_hour:g}:00 local, 24 h in {day_s:g} s, "
            f"for {duration_s:g} s from {_hhmm(settings.start_hour_utc)} UTC",
            flush=True,
        )
    # Ctrl-C (or SIGTERM) stops the sending and still prints the table of what was sent
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        report = await run_load(
            settings,
            broker_url=url,
            token=token,
            ssl_context=_ssl_context(url),
            on_window=progress,
            stop=stop,
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if table:
        print(report_table(report))
    else:
        print(json.dumps(report_json(report), indent=2))
    return 0


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    broker_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn load`, added with cpn.cli's `add` and `broker_arg`."""
    load = add(
        "load",
        help="send a daily load that moves across client regions to a service (docs/load.md)",
    )
    load.add_argument("service", metavar="SERVICE", help="the managed service's name")
    load.add_argument(
        "--peak-rps", type=float, default=10.0, help="requests/s of a region at its local peak"
    )
    load.add_argument(
        "--day", default="10m", metavar="DURATION", help="wall time of one 24 h day (10m)"
    )
    load.add_argument(
        "--duration", metavar="DURATION", help="how long to send (default: one --day)"
    )
    load.add_argument(
        "--regions", metavar="ID,ID", help="client regions (default: the service's clients)"
    )
    load.add_argument(
        "--start-hour", type=float, default=0.0, metavar="H", help="virtual UTC hour at start"
    )
    load.add_argument(
        "--peak-hour", type=float, default=20.0, metavar="H", help="local hour of the peak (20)"
    )
    load.add_argument(
        "--peak-to-trough", type=float, default=4.0, help="highest / lowest rate of a day (4)"
    )
    load.add_argument(
        "--utc-offset",
        metavar="ID=H,...",
        help="hours ahead of UTC per region (default: regions.yaml, longitude / 15)",
    )
    load.add_argument(
        "--stream", action="store_true", help="streamed answers: TTFT is the first event"
    )
    load.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    load.add_argument("--every", default="10s", metavar="DURATION", help="progress period")
    load.add_argument("--timeout", default="60s", metavar="DURATION", help="per request")
    load.add_argument("--max-in-flight", type=int, default=2_000, help="open requests at most")
    load.add_argument("--seed", type=int, help="seed of the arrivals (default: random)")
    broker_arg(load)
    load.set_defaults(func=cmd_load)
