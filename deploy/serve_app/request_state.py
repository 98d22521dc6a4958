"""One request at the edge, from admission to its last frame, as one object (vLLM v1's RequestState).

    Admission.admit            -> Ticket: the request's place at the edge
    ClusterEngineClient.generate(request, ticket) -> RequestState, an async iterator of OutputFrames:
        ticket                    released exactly once, when the request ends or is closed
        text, output so far       what the client has: a resume on another worker starts from it
        stream, place, tried      the worker stream read now, the router's count of it, the workers tried
        budget                    one RetryBudget: dispatches left and ONE deadline
    its last frame, or aclose() -> the ticket and the router's place given back, the outcome metered

The client advances it (`RequestOwner.next_frame`); the state keeps what the request is. It is
closed by whoever holds it, even before its first frame: never by the garbage collector.

The worst-case time to an error frame is one number, RECOVERY_DEADLINE_S: once a request needs a
worker (it arrived, or the worker streaming it was lost), every wait of its dispatch (router calls,
a dead router's successor, a worker adopting it, the pauses between tries) ends by one deadline
that many seconds later; a frame from a worker clears it. A router that never answers, a cluster
with no worker left: the request's error frame comes by the deadline.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol, TypeVar

from actors.output_stream import TextAssembler
from scheduler.messages import FINISH_CANCELLED, FINISH_ERROR, GenerateRequest, HandoffState, OutputFrame

if TYPE_CHECKING:
    from actors.frame_stream import FrameStream
    from cluster.router import WorkerPick
    from deploy.openai_api.admission import Ticket

# From the moment a request needs a worker to its error frame, at worst (see the module's docstring).
# Above the router's own wait for its workers after a restart (cluster/router.py REBUILD_WAIT_S).
RECOVERY_DEADLINE_S = 15.0
RETRY_INTERVAL_S = 0.2   # between two tries of a dispatch (a router being remade, a model being placed)
OUTCOME_OK = "ok"

T = TypeVar("T")


class DeadlinePassed(Exception):
    """A request's recovery deadline passed before a worker streamed it."""


@dataclass
class RetryBudget:
    """How much a request may retry: `max_attempts` dispatches to a worker, and one deadline,
    `recovery_s` after the request began to need a worker; its next frame clears it."""

    max_attempts: int
    recovery_s: float = RECOVERY_DEADLINE_S
    clock: Callable[[], float] = time.monotonic
    attempts: int = 0
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.recovery_s >= 0:
            raise ValueError(f"recovery_s must be >= 0, got {self.recovery_s}")

    def need_worker(self) -> None:
        """The request has no worker streaming it: the deadline runs (from the first need)."""
        if self.deadline is None:
            self.deadline = self.clock() + self.recovery_s

    def progressed(self) -> None:
        """A worker streamed it: the next loss starts a new deadline."""
        self.deadline = None

    def attempt(self) -> bool:
        """Spend one dispatch; False when none is left."""
        if self.attempts >= self.max_attempts:
            return False
        self.attempts += 1
        return True

    def left_s(self) -> float:
        return math.inf if self.deadline is None else max(0.0, self.deadline - self.clock())

    @property
    def expired(self) -> bool:
        return self.left_s() <= 0

    async def bounded(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`, cut at the deadline (DeadlinePassed)."""
        left = self.left_s()
        try:
            return await asyncio.wait_for(awaitable, None if math.isinf(left) else left)
        except asyncio.TimeoutError:
            raise DeadlinePassed(f"no answer within the request's recovery deadline of {self.recovery_s:g} s") \
                from None

    async def pause(self) -> None:
        """Wait before the next try; DeadlinePassed when there is no time left for one."""
        if self.expired:
            raise DeadlinePassed(f"not recovered within the request's deadline of {self.recovery_s:g} s")
        await asyncio.sleep(min(RETRY_INTERVAL_S, self.left_s()))


class RequestOwner(Protocol):
    """What a RequestState asks of the client that owns it."""

    async def next_frame(self, state: "RequestState") -> OutputFrame: ...

    def request_ended(self, state: "RequestState") -> None: ...


class RequestState:
    """One request at the edge; iterate it for its frames, `aclose()` it to stop it."""

    def __init__(self, request: GenerateRequest, owner: RequestOwner, budget: RetryBudget,
                 ticket: "Ticket | None" = None) -> None:
        self.request = request
        self.ticket = ticket
        self.budget = budget
        self.text: TextAssembler | None = None   # made once the tokenizer is at hand (its first frame)
        self.output_token_ids: list[int] = []    # what the client has: a resume starts from it
        self.token_times: list[float] = []
        self.num_resumes = 0
        self.stream: "FrameStream | None" = None   # the worker stream read now
        self.place: "WorkerPick | None" = None     # the worker the router counts it on, until released
        self.tried: list[str] = []                 # workers dispatched to, in order (the last one read)
        self.outcome: str | None = None            # ok | error | cancelled, once it ended
        self._owner = owner

    # ---- the stream ---------------------------------------------------------------------

    def __aiter__(self) -> "RequestState":
        return self

    async def __anext__(self) -> OutputFrame:
        if self.outcome is not None:
            raise StopAsyncIteration
        try:
            frame = await self._owner.next_frame(self)
        except (StopAsyncIteration, asyncio.CancelledError):   # cancelled with its consumer
            self.end(FINISH_CANCELLED)
            raise
        except BaseException:
            self.end(FINISH_ERROR)
            raise
        if frame.finished:
            self.end(OUTCOME_OK if frame.finish_reason != FINISH_ERROR else FINISH_ERROR)
        return frame

    async def aclose(self) -> None:
        """Stop the request however far it got (the one abort path): its worker stream is
        cancelled, its place at the router and at the edge given back."""
        self.end(FINISH_CANCELLED)

    # ---- what the client has --------------------------------------------------------------

    def sent(self, frame: OutputFrame) -> OutputFrame:
        """`frame` goes to the client: its text made, its output kept, the deadline cleared."""
        assert self.text is not None, "the text assembler is made before the first frame"
        self.text.fill(frame)
        self.output_token_ids += frame.token_ids
        self.token_times += frame.token_times
        self.budget.progressed()
        if self.ticket is not None:
            self.ticket.first_token()
        return frame

    def error(self, message: str, worker_id: str | None = None) -> OutputFrame:
        """The request's last frame when it cannot go on: a clear error, never a silent cut."""
        if self.output_token_ids:
            message += f"; {len(self.output_token_ids)} tokens were sent"
        return OutputFrame(self.request.request_id, finish_reason=FINISH_ERROR, error=message,
                           num_prompt_tokens=len(self.request.prompt_token_ids), worker_id=worker_id)

    def continuing(self) -> HandoffState:
        """The request as another worker adopts it after a loss: prompt + output so far, the
        text sent not sent again; a new id (the lost worker may have left an adopted copy
        under the old one on this very worker, held until its stream-wait runs out)."""
        self.num_resumes += 1
        resumed = dataclasses.replace(self.request, request_id=f"{self.request.request_id}.resume{self.num_resumes}")
        num_chars = self.text.num_sent_chars if self.text is not None else 0
        return HandoffState.continuing(resumed, self.output_token_ids, self.token_times, num_chars)

    # ---- its end ------------------------------------------------------------------------

    def end(self, outcome: str) -> None:
        """Once: the worker's stream stopped if unfinished, the ticket released, the owner told."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        if self.stream is not None and not self.stream.ended:
            self.stream.cancel()
        if self.ticket is not None:
            self.ticket.release()
        self._owner.request_ended(self)

