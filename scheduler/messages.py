"""Typed messages that cross process boundaries (ingress <-> router <-> worker).

Only diffs travel: a request is sent once; afterwards each OutputFrame carries just the
tokens produced since the previous frame (never one actor call per token).
Both types round-trip through plain dicts so they can be msgpack-encoded.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO = field(default_factory=SLO)
    arrival_time: float = 0.0  # wall clock (time.time()) when the system accepted it

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if not self.model:
            raise ValueError("model must be non-empty")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling_params": self.sampling_params.to_dict(),
            "slo": asdict(self.slo),
            "arrival_time": self.arrival_time,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "GenerateRequest":
        return cls(
            request_id=d["request_id"],
            model=d["model"],
            prompt_token_ids=tuple(d["prompt_token_ids"]),
            sampling_params=SamplingParams.from_dict(d.get("sampling_params", {})),
            slo=SLO(**d.get("slo", {})),
            arrival_time=d.get("arrival_time", 0.0),
        )


# Named actors of one tokenmux cluster, looked up by name from any process (the worker
# finds the router by it without importing the control plane).
ROUTER_NAME = "tokenmux-router"
PLACEMENT_NAME = "tokenmux-placement"

# finish_reason values, as in the OpenAI API, plus "cancelled" and "error".
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@dataclass
class OutputFrame:
    """New output of one request since its previous frame.

    token_times[i] is the wall-clock time token_ids[i] was produced (for TTFT/TBT).
    An error is a value in the stream (finish_reason="error", error=message), never an
    exception through the layers.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    worker_id: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OutputFrame":
        return cls(**d)
