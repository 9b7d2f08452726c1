"""Perception from Slurm: the cluster's nodes, CPUs, memory and GPUs by GRES type, and what of
them is allocated, from ``scontrol show node -o`` (one line per node).

A node that cannot take work (drained, draining, down, failing, powered off, ...) counts for
neither capacity nor free: placement sees only what Slurm would schedule now. GPUs are read from
the node's configured and allocated TRES (``CfgTRES`` / ``AllocTRES``: ``gres/gpu:<type>=<n>``)
and mapped back to catalog models through the site's ``executor.slurm.gres_types`` (default: the
model in lower case); a GRES type no catalog model maps to is ignored, and logged once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# node state words (scontrol's State=IDLE+DRAIN) that take a node out of service
UNUSABLE = frozenset(
    {
        "DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "FUTURE", "MAINT",
        "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "POWERING_UP",
        "REBOOT_REQUESTED", "REBOOT_ISSUED", "INVALID_REG", "UNKNOWN", "RESERVED", "INVAL",
    }
)  # fmt: skip

_FIELD = re.compile(r"(\w+)=(\S*)")
_MEM = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)$")
_UNIT_MB = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2, "P": 1024.0**3}


@dataclass(frozen=True)
class SlurmNode:
    name: str
    states: frozenset[str]
    partitions: tuple[str, ...]
    cpus: int
    cpus_alloc: int
    mem_mb: int
    mem_alloc_mb: int
    gpus: Mapping[str, int]  # GRES type -> count
    gpus_alloc: Mapping[str, int]
    reason: str = ""

    @property
    def usable(self) -> bool:
        return not (self.states & UNUSABLE)


@dataclass(frozen=True)
class SlurmCapacity:
    """The cluster as placement should see it: totals and free over the usable nodes."""

    devices: dict[str, int] = field(default_factory=dict)  # catalog model -> count
    devices_free: dict[str, int] = field(default_factory=dict)
    cpu_cores: int = 0
    cpu_free: int = 0
    mem_gb: float = 0.0
    mem_free_gb: float = 0.0
    nodes: int = 0
    nodes_out: tuple[str, ...] = ()  # nodes out of service ("vm: DRAIN (maintenance)")


def parse_nodes(text: str) -> list[SlurmNode]:
    """``scontrol show node -o`` output -> nodes (pure)."""
    nodes = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        name = fields.get("NodeName")
        if not name:
            continue
        reason = ""
        if "Reason=" in line:
            reason = line.split("Reason=", 1)[1].split(" [", 1)[0].strip()
        cfg, alloc = _tres(fields.get("CfgTRES", "")), _tres(fields.get("AllocTRES", ""))
        nodes.append(
            SlurmNode(
                name=name,
                states=frozenset(re.split(r"[+*~#$@!%^-]", fields.get("State", "UNKNOWN")) or ()),
                partitions=tuple(p for p in fields.get("Partitions", "").split(",") if p),
                cpus=_int(fields.get("CPUTot")),
                cpus_alloc=_int(fields.get("CPUAlloc")),
                mem_mb=_int(fields.get("RealMemory")),
                mem_alloc_mb=_int(fields.get("AllocMem")),
                gpus=_gpus(cfg),
                gpus_alloc=_gpus(alloc),
                reason=reason,
            )
        )
    return nodes


def capacity(
    nodes: Iterable[SlurmNode],
    *,
    models: Mapping[str, str],
    partition: str | None = None,
) -> SlurmCapacity:
    """Totals and free over the usable nodes of ``partition`` (all nodes when None) (pure).

    ``models`` maps a GRES type (lower case) to the catalog model it is.
    """
    devices: dict[str, int] = {}
    free: dict[str, int] = {}
    cpu = cpu_free = 0
    mem = mem_free = 0.0
    count = 0
    out = []
    for node in nodes:
        if partition is not None and partition not in node.partitions:
            continue
        if not node.usable:
            why = "+".join(sorted(node.states)) + (f" ({node.reason})" if node.reason else "")
            out.append(f"{node.name}: {why}")
            continue
        count += 1
        cpu += node.cpus
        cpu_free += max(0, node.cpus - node.cpus_alloc)
        mem += node.mem_mb / 1024
        mem_free += max(0, node.mem_mb - node.mem_alloc_mb) / 1024
        for kind, n in node.gpus.items():
            model = models.get(kind.lower())
            if model is None:
                _unknown_type(kind)
                continue
            devices[model] = devices.get(model, 0) + n
            taken = node.gpus_alloc.get(kind, 0)
            free[model] = free.get(model, 0) + max(0, n - taken)
    return SlurmCapacity(
        devices=devices,
        devices_free=free,
        cpu_cores=cpu,
        cpu_free=cpu_free,
        mem_gb=round(mem, 3),
        mem_free_gb=round(mem_free, 3),
        nodes=count,
        nodes_out=tuple(out),
    )


_warned: set[str] = set()


def _unknown_type(kind: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(
            "Slurm GRES type gpu:%s maps to no catalog model (executor.slurm.gres_types); "
            "its GPUs are not published",
            kind,
        )


def _tres(text: str) -> dict[str, str]:
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def _gpus(tres: Mapping[str, str]) -> dict[str, int]:
    """``gres/gpu:<type>=<n>`` entries; an untyped ``gres/gpu`` only when no type is listed."""
    typed = {k.split(":", 1)[1]: _int(v) for k, v in tres.items() if k.startswith("gres/gpu:")}
    if not typed and "gres/gpu" in tres:
        return {"gpu": _int(tres["gres/gpu"])}
    return typed


def _int(text: str | None) -> int:
    if not text:
        return 0
    match = _MEM.match(text)
    if match is None:
        return 0
    return int(float(match.group(1)) * _UNIT_MB[match.group(2)])
