"""broker.model.frozen.maker: what it makes is the class's own, frozen instance."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from broker.model.frozen import maker
from broker.placement.place import Decision
from broker.placement.pricing import Breakdown
from broker.placement.site import SiteOffer
from sites.model.spec import Prices


@dataclass(frozen=True, slots=True)
class _Sample:
    a: int
    b: str = "b"
    c: tuple[int, ...] = field(default_factory=tuple)
    d: list[int] = field(default_factory=list, compare=False, hash=False)


def test_made_instances_are_the_class_own_equal_hashed_and_frozen() -> None:
    make = maker(_Sample)
    got, want = make(1, c=(3,)), _Sample(1, c=(3,))
    assert type(got) is _Sample and got == want and repr(got) == repr(want)
    assert make(1) == _Sample(1) and hash(make(2, "z")) == hash(_Sample(2, "z"))
    assert make(1).d is not make(1).d  # a default factory runs per instance
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.a = 2  # type: ignore[misc]
    assert dataclasses.replace(got, b="q") == _Sample(1, "q", (3,))
    assert pickle.loads(pickle.dumps(got)) == want and copy.copy(got) == want
    with pytest.raises(TypeError):
        make()  # the class's own signature: a is required


def test_the_hot_path_classes_build_as_their_constructors_do() -> None:
    b = maker(Breakdown)(1.5, 0.25, 0.0, 0.5)
    assert b == Breakdown(1.5, 0.25, 0.0, 0.5) and b.total_usd == 1.75
    prices = Prices(usd_per_gpu_hour={"H100": 2.0})
    args = ("s", "east", "CN", True, False, {"H100": 8}, 64, 512.0, {"H100": 80.0}, prices)
    offer = maker(SiteOffer)(*args)
    assert offer == SiteOffer(*args) and offer.labels == {} and offer.spare is None
    fields = dict(
        job="j", site="s", region="east", model="H100", gpus=1, cost_usd=2.0, breakdown=b,
        runner_up=None, feasible=0, reason="r",
    )  # fmt: skip
    assert maker(Decision)(**fields) == Decision(**fields)  # type: ignore[arg-type]


def test_only_frozen_slots_dataclasses_without_post_init() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    for cls in (NoSlots, NotFrozen, Post, int):
        with pytest.raises(TypeError):
            maker(cls)
