"""Service-level objectives of one request: time to first token and time between tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 10.0
    tbt_s: float = 0.5

    def __post_init__(self) -> None:
        if self.ttft_s <= 0:
            raise ValueError(f"ttft_s must be > 0, got {self.ttft_s!r}")
        if self.tbt_s <= 0:
            raise ValueError(f"tbt_s must be > 0, got {self.tbt_s!r}")

    def deadline(self, start: float, k: int) -> float:
        """Deadline of output token k (0-based) for a request that started at `start`."""
        return start + self.ttft_s + k * self.tbt_s
