"""Service-level objectives of one request: time to first token and time between tokens."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.validation import check_real

# Outside this range an SLO means nothing a scheduler can act on, and its quotient with a
# step time (scheduler/quota.py) would underflow or overflow: 100 us .. about 11 days.
MIN_SLO_S, MAX_SLO_S = 1e-4, 1e6


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 10.0
    tbt_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s"):
            value = check_real(name, getattr(self, name))
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
            if not MIN_SLO_S <= value <= MAX_SLO_S:
                raise ValueError(f"{name} must be in [{MIN_SLO_S:g}, {MAX_SLO_S:g}] seconds, got {value!r}")

    def deadline(self, start: float, k: int) -> float:
        """Deadline of output token k (0-based) for a request that started at `start`."""
        return start + self.ttft_s + k * self.tbt_s
