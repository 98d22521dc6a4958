"""The records one step crosses the policy-engine boundary in (vLLM v1's SchedulerOutput and
ModelRunnerOutput): the policy's `schedule` makes a SchedulerOutput, the engine (actors/engine.py;
the fleet simulator's cluster/planner/sim_worker.py) runs it and hands a StepResult back to the
policy's `update`. One producer and one field order each: a KV copy is a KVCopy, never a tuple
whose order depends on the direction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(frozen=True, slots=True)
class KVCopy:
    """One request's KV blocks to copy before a step, block for block: src[i] -> dst[i].
    A swap-out copies device blocks to host blocks; a swap-in, host blocks to device blocks."""

    request_id: str
    src: list[int]
    dst: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    model: str  # the model this step runs
    requests: list[Request]  # each advances num_computed_tokens -> num_tokens
    is_prefill: bool
    # request id -> tokens the step computes for it (a decode run: its first step's); every
    # request of `requests` has its entry
    num_scheduled_tokens: dict[str, int]
    swap_out: list[KVCopy] = field(default_factory=list)  # device -> host, done first
    swap_in: list[KVCopy] = field(default_factory=list)  # host -> device, done next
    prefetch_model: str | None = None  # model expected next: start copying its weights now
    num_steps: int = 1  # decode steps the engine may run back to back with this batch (policy._lookahead)
    # requests whose prefill is split: this step computes a chunk that stops short of
    # num_tokens, and no token comes out of it (policy._prefill_step)
    partial: frozenset[str] = frozenset()

    @classmethod
    def decode(cls, model: str, requests: list[Request]) -> SchedulerOutput:
        """A decode step of `requests` (each computes what it lacks of num_tokens: one token)."""
        return cls(model, requests, False, {r.request_id: r.num_new_tokens for r in requests})

    def add_decode(self, request: Request) -> None:
        """`request` joins this decode step."""
        self.requests.append(request)
        self.num_scheduled_tokens[request.request_id] = request.num_new_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens the step computes, over all its requests."""
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step of a SchedulerOutput produced, for the policy's `update`."""

    sampled: dict[str, int]  # request id -> its token: every request of the step but a split prefill's chunk
    now: float  # when the tokens came out
    step_time_s: float = 0.0  # the forward and sampling
    switch_time_s: float = 0.0  # what the step waited for output.model's weights
    # what the swap-in that brought them took, hidden by a prefetch or not (None: no swap
    # since the model last ran)
    copy_time_s: float | None = None
    # teach the estimator these times now (a multi-step run teaches it once, after its last step)
    observe: bool = True
