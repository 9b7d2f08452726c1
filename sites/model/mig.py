"""Multi-Instance GPU geometry (`MigSpec`: a GPU's slices and the profiles it can be cut into, a
catalog entry's `mig:`) and NVIDIA's rules for placing instances on one device
(`layout_problem`: an exact backtracking search over the profiles' allowed starts). Pure.
The catalog (sites.model.catalog) names a MIG instance as a pseudo-model and checks a site's
partitions with these rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sites.model.spec import MIG_PROFILE_RE

# strict: a YAML string or boolean is a mistake, not a number to coerce.
Figure = Annotated[float, Field(gt=0, strict=True)]
"""A published figure (TFLOPS, GB, W, ...): positive, and a number as written."""


class MigProfile(BaseModel):
    """One MIG GPU-instance profile: its slices of the device and where it may start.

    ``starts`` are the memory-slice indices NVML allows a GPU instance of this profile to begin
    at (``nvidia-smi mig -lgipp``; nvmlGpuInstancePlacement_t.start); the instance occupies
    memory slices [start, start + memory_slices) and compute slices
    [start, start + compute_slices).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_slices: int = Field(ge=1, le=32, description="compute (GPC) slices it takes")
    memory_slices: int = Field(ge=1, le=32, description="memory slices it takes")
    mem_gb: Figure = Field(description="device memory of the instance, GB (the profile's name)")
    max_instances: int = Field(ge=1, le=32, description="instances one device holds at most")
    starts: tuple[Annotated[int, Field(ge=0, le=31)], ...] = Field(
        min_length=1, description="allowed start slice indices"
    )

    @field_validator("starts")
    @classmethod
    def _sorted_unique(cls, starts: tuple[int, ...]) -> tuple[int, ...]:
        if list(starts) != sorted(set(starts)):
            raise ValueError("starts must be ascending and distinct")
        return starts


class MigSpec(BaseModel):
    """A GPU's Multi-Instance GPU geometry: its slices and the profiles it can be cut into."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compute_slices: int = Field(ge=1, le=32, description="compute slices of the whole device")
    memory_slices: int = Field(ge=1, le=32, description="memory slices of the whole device")
    profiles: dict[str, MigProfile] = Field(min_length=1, description="name -> profile")

    @model_validator(mode="after")
    def _profiles_fit(self) -> MigSpec:
        for name, profile in self.profiles.items():
            if not re.fullmatch(MIG_PROFILE_RE, name):
                raise ValueError(f"profile name {name!r} must match {MIG_PROFILE_RE}")
            for start in profile.starts:
                if (
                    start + profile.compute_slices > self.compute_slices
                    or start + profile.memory_slices > self.memory_slices
                ):
                    raise ValueError(
                        f"profile {name}: start {start} runs past the device's "
                        f"{self.compute_slices} compute / {self.memory_slices} memory slices"
                    )
        return self


def layout_problem(model: str, mig: MigSpec, layout: Mapping[str, int]) -> str | None:
    """Why ``layout`` (MIG profile -> instances) does not fit one ``model`` device of geometry
    ``mig``, or None.

    NVIDIA's placement rules (MIG User Guide, "Concepts > Partitioning" and "Supported MIG
    Profiles"; NVML nvmlDeviceGetGpuInstancePossiblePlacements): a GPU instance of a profile
    starts only at that profile's allowed slice indices, occupies memory slices
    [start, start + memory_slices), and may not overlap an occupied slice; a profile has a
    maximum instance count per device. Compute slices [start, start + compute_slices) are kept
    apart as well.
    """
    what = " + ".join(f"{profile} x {n}" for profile, n in layout.items())
    unknown = [profile for profile in layout if profile not in mig.profiles]
    if unknown:
        return (
            f"{model} has no MIG profile {unknown[0]!r} (its profiles: {', '.join(mig.profiles)})"
        )
    compute = sum(mig.profiles[p].compute_slices * n for p, n in layout.items())
    if compute > mig.compute_slices:
        return f"{what} does not fit one {model}: {compute} of {mig.compute_slices} compute slices"
    memory = sum(mig.profiles[p].memory_slices * n for p, n in layout.items())
    if memory > mig.memory_slices:
        return f"{what} does not fit one {model}: {memory} of {mig.memory_slices} memory slices"
    for profile, n in layout.items():
        most = mig.profiles[profile].max_instances
        if n > most:
            return f"{what} does not fit one {model}: at most {most} {profile} on one device"
    # largest first: they have the fewest starts, so the search fails (or succeeds) early
    instances = sorted(
        (name for name, n in layout.items() for _ in range(n)),
        key=lambda name: (
            -mig.profiles[name].memory_slices,
            -mig.profiles[name].compute_slices,
            name,
        ),
    )
    if not _place(instances, mig, 0, 0, 0, -1):
        return (
            f"{what} does not fit one {model}: no non-overlapping allowed start slices for them "
            "(NVIDIA MIG placement rules)"
        )
    return None


def _place(
    instances: list[str], mig: MigSpec, k: int, compute: int, memory: int, after: int
) -> bool:
    """Backtracking: can instances[k:] start at free allowed slices? ``compute`` and ``memory``
    are bit masks of occupied slices; ``after`` the start of the previous identical instance
    (identical instances are taken in ascending starts, so no arrangement is tried twice)."""
    if k == len(instances):
        return True
    profile = mig.profiles[instances[k]]
    same = k > 0 and instances[k - 1] == instances[k]
    for start in profile.starts:
        if same and start <= after:
            continue
        c = ((1 << profile.compute_slices) - 1) << start
        m = ((1 << profile.memory_slices) - 1) << start
        if c & compute or m & memory:
            continue
        if _place(instances, mig, k + 1, compute | c, memory | m, start):
            return True
    return False
