"""Limits and defaults the OpenAI ingress applies to every request."""
from __future__ import annotations

from dataclasses import dataclass, field

from deploy.openai_api.admission import AdmissionConfig
from deploy.openai_api.auth import key_digests
from scheduler.slo import SLO
from scheduler.validation import check_real

# A 128k-token prompt is about 0.5 MB of text, twice that as escaped JSON: 4 MiB leaves room,
# and a body beyond it is refused before it is read in full, parsed or tokenised.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# A request with no output for this long is stopped with an error: a wedged worker or a lost
# reply must not hold a client for ever. Admission keeps honest waits far below it.
DEFAULT_STALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class IngressConfig:
    max_tokens_cap: int = 4096  # a request may not ask for more completion tokens than this
    default_max_tokens: int = 256  # when the request does not say (clipped to the context left)
    default_temperature: float = 1.0  # the OpenAI API's default
    default_slo: SLO = field(default_factory=SLO)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    api_keys: tuple[str, ...] = ()  # keys or `sha256:<hex>`, held as digests (openai_api/auth.py); () = open
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # 429 bounds (openai_api/admission.py)
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S  # no frame for this long: the request fails; None = never

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens_cap, int) or self.max_tokens_cap <= 0:
            raise ValueError(f"max_tokens_cap must be a positive integer, got {self.max_tokens_cap!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens <= 0:
            raise ValueError(f"default_max_tokens must be a positive integer, got {self.default_max_tokens!r}")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap ({self.max_tokens_cap})"
            )
        object.__setattr__(self, "api_keys", key_digests(self.api_keys))
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if self.stall_timeout_s is not None and check_real("stall_timeout_s", self.stall_timeout_s) <= 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds (or None), got {self.stall_timeout_s!r}")
        if check_real("default_temperature", self.default_temperature) < 0:
            raise ValueError(f"default_temperature must be >= 0, got {self.default_temperature!r}")
