"""Checks the typed messages share: a number that reaches the scheduler or the sampler is
finite and normal, an integer is an int.

NaN slips through ordinary range checks (`nan < 0` and `nan > 0` are both False), inf
and denormals (1e-40) overflow once divided into logits or step times; any of them in one
request would fail a whole engine step. So the messages refuse them at construction, with
a message that starts with the field's name (the HTTP edge turns it into a 400 naming it).
"""
from __future__ import annotations

import math

# The smallest normal float32: sampling and step-time arithmetic run on float32 tensors,
# where anything nonzero below this is a denormal (1e-40 is one there, though not in Python).
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


def check_real(name: str, value: object) -> float:
    """`value` as a float, or ValueError when it is not a finite number that is zero or a
    normal float32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value and abs(value) < FLOAT32_MIN_NORMAL:
        raise ValueError(f"{name} must be zero or a normal float32, got the denormal {value!r}")
    return float(value)


def check_int(name: str, value: object, low: int, high: int) -> int:
    """`value` if it is an int (not a bool) in [low, high], else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
    return value
