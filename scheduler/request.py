"""The scheduler's mutable view of one request.

There is no prefill or decode phase: each request has `num_computed_tokens` (tokens whose
KV is in the device pool) and a step lets it catch up with `num_tokens`. A prefill is a
step of many tokens, a decode step is one token, a resume after recompute is many again.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.messages import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # KV not on the device: never prefilled, or preempted by recompute
    RUNNING = "running"  # KV of num_computed_tokens lives in `block_ids`
    SWAPPED = "swapped"  # KV preserved in host memory (`host_block_ids`)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish_reason of a finished status (None while unfinished)."""
        return _FINISH_REASON.get(self)


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FINISH_STOP,
    RequestStatus.FINISHED_LENGTH: FINISH_LENGTH,
    RequestStatus.FINISHED_ABORTED: FINISH_CANCELLED,
}


@dataclass(eq=False, slots=True)   # slots: the hot loop reads these fields every step, on cold caches
class Request:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO = field(default_factory=SLO)
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if not self.model:
            raise ValueError(f"request {self.request_id}: model must be non-empty")
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: prompt must contain at least one token")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @classmethod
    def from_generate_request(cls, req: GenerateRequest, eos_token_ids=()) -> "Request":
        return cls(
            request_id=req.request_id,
            model=req.model,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            slo=req.slo,
            arrival_time=req.arrival_time,
            eos_token_ids=tuple(eos_token_ids),
        )

    def to_generate_request(self) -> GenerateRequest:
        """The GenerateRequest this was made from (what a KV handoff sends on)."""
        return GenerateRequest(self.request_id, self.model, tuple(self.prompt_token_ids), self.sampling_params,
                               self.slo, self.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step computes for this request."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold KV for (prompt + max_tokens)."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """The finished status that `token_id` (just appended) causes, or None."""
        params = self.sampling_params
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, model={self.model!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)}, "
            f"host_blocks={len(self.host_block_ids)})"
        )
