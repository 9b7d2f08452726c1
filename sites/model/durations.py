"""Durations in config files: a number of seconds, or number+unit parts ('90s', '5m', '1d12h').

`Duration` is the pydantic type every settings model uses for a field in seconds, so a broker
setting and the same setting overridden in a simulation scenario read the same way.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

__all__ = [
    "DURATION_PATTERN",
    "POSITIVE_DURATION_PATTERN",
    "Duration",
    "PositiveDuration",
    "parse_duration_s",
]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|m|s)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration_s(value: Any) -> float:
    """Seconds from a number (seconds) or a string of number+unit parts: '7d', '1d12h', '90s'."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 3600, '12h' or '1d6h'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"{value!r} is not a duration (number + unit s/m/h/d, e.g. '1d12h')")
        seconds = math.fsum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise ValueError("expected a duration such as 3600, '12h' or '1d6h'")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"duration must be finite and >= 0, got {value!r}")
    return seconds


DURATION_PATTERN = r"^\s*([0-9]+(\.[0-9]+)? *[dhmsDHMS] *)+\s*$"
"""What parse_duration_s reads from a string, for JSON Schema (a space inside a number, which it
also reads, left out)."""
DurationInput = Annotated[float, Field(ge=0)] | Annotated[str, Field(pattern=DURATION_PATTERN)]
Duration = Annotated[float, BeforeValidator(parse_duration_s, json_schema_input_type=DurationInput)]

_PART = r"[0-9]+(\.[0-9]+)? *[dhmsDHMS] *"
_NONZERO = r"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*) *[dhmsDHMS] *"
POSITIVE_DURATION_PATTERN = rf"^\s*({_PART})*{_NONZERO}({_PART})*\s*$"
"""DURATION_PATTERN with one part above zero (no lookahead: every generator reads this)."""
PositiveDurationInput = (
    Annotated[float, Field(gt=0)] | Annotated[str, Field(pattern=POSITIVE_DURATION_PATTERN)]
)
PositiveDuration = Annotated[
    float, BeforeValidator(parse_duration_s, json_schema_input_type=PositiveDurationInput)
]
"""A Duration whose field says gt=0: the document says so too (Duration's input schema does
not carry the field's bound)."""
