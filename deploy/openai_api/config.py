"""Limits and defaults the OpenAI ingress applies to every request."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.slo import SLO


@dataclass(frozen=True)
class IngressConfig:
    max_tokens_cap: int = 4096  # a request may not ask for more completion tokens than this
    default_max_tokens: int = 256  # when the request does not say (clipped to the context left)
    default_temperature: float = 1.0  # the OpenAI API's default
    default_slo: SLO = field(default_factory=SLO)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens_cap, int) or self.max_tokens_cap <= 0:
            raise ValueError(f"max_tokens_cap must be a positive integer, got {self.max_tokens_cap!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens <= 0:
            raise ValueError(f"default_max_tokens must be a positive integer, got {self.default_max_tokens!r}")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap ({self.max_tokens_cap})"
            )
        if self.default_temperature < 0:
            raise ValueError(f"default_temperature must be >= 0, got {self.default_temperature!r}")
