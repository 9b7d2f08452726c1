"""Constructors for frozen slots dataclasses at a plain dataclass's cost.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__` (its
own `__setattr__` refuses): on Python 3.11, 1.9 us for 14 fields where a plain slots dataclass
takes 0.3 us. The paths that make one per placement and per release (an offer with capacity
taken or given back, the placement decision, its cost breakdown: a simulated job makes five)
use `maker(cls)` instead: a plain slots twin of `cls`, with the same fields, defaults and
slots, initialises the instance and then its `__class__` becomes `cls`. CPython allows that
assignment between classes of one layout; what comes out is an ordinary `cls`, equal, hashed,
printed and frozen as one made by `cls(...)` is (tests/broker/model/test_frozen.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NONE = object()  # a field with a default factory that was not given


def maker(cls: type[T]) -> Callable[..., T]:
    """A constructor taking `cls(...)`'s arguments, for a frozen slots dataclass without
    `__post_init__` or init-only fields; TypeError for any other class."""
    options = getattr(cls, "__dataclass_params__", None)
    if options is None or not options.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen slots dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has __post_init__: its own __init__ must run")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__} has fields outside __init__")
    spec = [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
        for f in fields
    ]
    twin: Any = dataclasses.make_dataclass(
        cls.__name__, spec, slots=True, eq=False, repr=False, match_args=False
    )
    if twin.__slots__ != cls.__dict__["__slots__"]:
        raise TypeError(f"{cls.__name__}: slots differ from its fields")
    # make(...) has cls's own signature, so that no *args and **kwargs are packed per call
    scope: dict[str, Any] = {"_twin": twin, "_cls": cls, "_set": object.__setattr__}
    params: list[str] = []
    lines: list[str] = []
    for i, f in enumerate(fields):
        if f.default is not dataclasses.MISSING:
            scope[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
        elif f.default_factory is not dataclasses.MISSING:
            scope[f"_f{i}"] = f.default_factory
            scope["_none"] = _NONE
            params.append(f"{f.name}=_none")
            lines.append(f"    if {f.name} is _none: {f.name} = _f{i}()")
        else:
            params.append(f.name)
    args = ", ".join(f.name for f in fields)
    source = "\n".join(
        [
            f"def make({', '.join(params)}):",
            *lines,
            f"    made = _twin({args})",
            "    _set(made, '__class__', _cls)",
            "    return made",
        ]
    )
    exec(source, scope)  # noqa: S102 - field names of a dataclass, nothing from outside
    make: Callable[..., T] = scope["make"]
    make.__doc__ = f"{cls.__name__}(...) (broker.model.frozen.maker)"
    make.__qualname__ = f"maker({cls.__name__})"
    return make
