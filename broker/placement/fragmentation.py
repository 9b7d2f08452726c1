"""Fragmentation-aware choice (FGD: Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC 2023): one place.

A node's free accelerators are *fragmented* for a request shape when that shape cannot use
them: all of them when the node lacks the cores or memory for it (or the shape asks for no
accelerator), else the devices with less room than a share asks (a fractional shape) or the
partly used devices (a whole-device shape), or all when fewer whole devices are free than it
asks. Against the mix of shapes a site has seen (`Mix`: each shape's popularity), a node's
expected fragmentation is the popularity-weighted sum; FGD puts a request where that sum
grows least. CPU-only work then lands where it takes no cores that accelerators need: on a
node without accelerators when one has room (`cpu_key`).

Pure, and bounded per request: a node's fragmentation depends on its state alone, so
`Scorer` remembers it per distinct state (nodes of one kind, empty or alike, share an
entry), for one version of the mix; the mix is folded in every MIX_EVERY requests, not on
each. No I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "MIX_EVERY",
    "MIX_SHAPES",
    "NO_MIX",
    "Learner",
    "Mix",
    "NodeState",
    "Scorer",
    "TaskShape",
    "frag",
]

MIX_SHAPES = 24  # the most popular shapes a mix keeps: a node's score is O(this)
MIX_EVERY = 64  # requests seen between two foldings of the mix (a new version)
_EPS = 1e-9

# a request's shape: (accelerators: 0 none, < 1 a share of one device, else whole devices,
# cores, memory GB)
TaskShape = tuple[float, int, float]


@dataclass(frozen=True, slots=True)
class NodeState:
    """What one node (or a site without nodes) has free of one accelerator model: whole
    devices, the free compute of each partly used device (largest first), cores, GB."""

    whole: int
    parts: tuple[float, ...]
    cpu: int
    mem_gb: float

    @property
    def free(self) -> float:
        return self.whole + sum(self.parts)


class Mix:
    """Request shapes with their popularity (summing to 1), at most MIX_SHAPES of them; a
    value (its scorer is a cache of what follows from it)."""

    __slots__ = ("_scorer", "shapes", "version")

    def __init__(self, shapes: tuple[tuple[TaskShape, float], ...], version: int = 0) -> None:
        self.shapes = shapes
        self.version = version
        self._scorer: Scorer | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mix) and self.shapes == other.shapes

    def __hash__(self) -> int:
        return hash(self.shapes)

    def scorer(self) -> Scorer:
        """The node scores against this mix, remembered with it."""
        if self._scorer is None:
            self._scorer = Scorer(self)
        return self._scorer

    @classmethod
    def of_counts(cls, counts: Mapping[TaskShape, float], version: int = 0) -> Mix:
        """The mix of shapes seen `counts` times: shapes of one accelerator demand are one
        class, with their mean cores and memory (a rare large shape, 8 whole devices say,
        keeps its class however its cores vary); the MIX_SHAPES most seen classes."""
        classes: dict[float, list[float]] = {}
        for (gpus, cpu, mem), n in counts.items():
            row = classes.setdefault(gpus, [0.0, 0.0, 0.0])
            row[0] += n
            row[1] += n * cpu
            row[2] += n * mem
        merged = {
            (gpus, round(c / n), round(m / n, 1)): n for gpus, (n, c, m) in classes.items() if n
        }
        top = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))[:MIX_SHAPES]
        total = sum(n for _, n in top)
        if total <= 0:
            return cls((), version)
        return cls(tuple((shape, n / total) for shape, n in top), version)

    @staticmethod
    def shape_of(gpus: float, cpu: int, mem_gb: float) -> TaskShape:
        """A request as the mix counts it: shares to 0.05, memory to whole GB."""
        g = round(gpus * 20) / 20 if 0 < gpus < 1 else float(gpus)
        return (max(g, 0.05) if gpus > 0 else 0.0, cpu, float(round(mem_gb)))


class Learner:
    """The shapes a site (or a cluster) has seen, folded into a new `Mix` every MIX_EVERY
    requests (so that scores remembered for one version serve many requests)."""

    __slots__ = ("_counts", "_since", "mix")

    def __init__(self, seen: Iterable[TaskShape] = ()) -> None:
        self._counts: Counter[TaskShape] = Counter(seen)
        self._since = 0
        self.mix = Mix.of_counts(self._counts)

    def saw(self, shape: TaskShape) -> None:
        self._counts[shape] += 1
        self._since += 1
        if self._since >= MIX_EVERY or not self.mix.shapes:
            self._since = 0
            self.mix = Mix.of_counts(self._counts, self.mix.version + 1)


def frag(node: NodeState, mix: Mix) -> float:
    """The node's expected fragmentation against the mix (module docstring), in devices."""
    total = node.free
    if total <= _EPS:
        return 0.0
    out = 0.0
    whole, parts, cpu, mem = node.whole, node.parts, node.cpu, node.mem_gb
    for (gpus, t_cpu, t_mem), p in mix.shapes:
        if gpus <= 0 or cpu < t_cpu or mem < t_mem - _EPS:
            out += p * total  # a shape that cannot use the node's devices
        elif gpus < 1:
            usable = whole + sum(x for x in parts if x >= gpus - _EPS)
            out += p * (total - usable)
        elif whole < gpus:
            out += p * total
        else:
            out += p * (total - whole)
    return out


class Scorer:
    """Expected fragmentation per node state, remembered for one mix (Mix.scorer)."""

    __slots__ = ("_known", "mix")

    def __init__(self, mix: Mix) -> None:
        self.mix = mix
        self._known: dict[NodeState, float] = {}

    def __call__(self, node: NodeState) -> float:
        known = self._known.get(node)
        if known is None:
            if len(self._known) > 65_536:
                self._known = {}
            known = self._known[node] = frag(node, self.mix)
        return known

    def delta(self, before: NodeState, after: NodeState) -> float:
        """How much the node's expected fragmentation grows by the placement."""
        return self(after) - self(before)


def cpu_key(node_free_devices: float) -> float:
    """CPU-only work's tie-break between nodes whose fragmentation grows alike: the node with
    fewer free accelerators first (none: a CPU node), so that its cores stay with them."""
    return node_free_devices


NO_MIX = Mix(())  # a site that has seen no request: every score is 0, the tie-breaks decide
