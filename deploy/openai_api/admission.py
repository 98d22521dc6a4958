"""Admission control at the HTTP edge: refuse (429) what could not start in time, and
never drop what was accepted.

Per model, the edge counts the requests it accepted that have not had their first token
yet (`waiting`), and in all the requests it is serving (`active`). A new request is refused
when
- its model already has `max_waiting` requests waiting, or the edge serves `max_active`
  (memory stays bounded whatever the load), or
- its predicted TTFT, (waiting + 1) / the model's first-token rate, exceeds
  `ttft_slo_multiple` x its own TTFT SLO (default 1: what is predicted to miss its SLO is
  refused; the prediction misses when overload slows the cluster, and a margin of 2 was used
  up at once: the chaos bench's accepted requests then waited 3-12x their SLO).
The first-token rate is measured only while a queue stands (between two first tokens with
requests waiting throughout): that is what the cluster delivers when busy. At light load
nothing waits, so nothing is predicted. Until a model's rate has been measured, at most
`cold_waiting` of its requests wait: a burst that comes first (a server just started, a model
idle until now) would otherwise be admitted up to `max_waiting` with no idea how fast it
drains (the chaos bench's 10x burst was: accepted requests then waited 12x their TTFT SLO).
The queue the cold bound lets form is what measures the rate.

How many requests the edge serves at once is also limited adaptively (AIMD, as TCP and
concurrency limiters do): the limit starts at `initial_active`, halves
(`limit_decrease`) when a request admitted under it gets its first token later than its
TTFT SLO (counted from when the edge began reading it), once per such request, and grows
by one with each request that started on time while at least half of it was in use.
The prediction above sees only the engines' queues; this sees what the edge itself costs.
On a small host the edge is what saturates first: at 10x overload on 2 cores the accepted
streams' own HTTP work slowed every stream, so requests already accepted held their
places for seconds, the edge reached Serve's max_ongoing_requests, and new requests
queued in Serve's proxy before any of this code saw them (TTFT p99 8-18 s against a 2 s
SLO, the first token soon after admission).

A refusal is a 429 in OpenAI's shape with `Retry-After` (seconds until the queue ahead is
predicted to be short enough, at least 1): the openai SDK retries it on its own. Counts are
per ingress replica (with R replicas the bounds are R times larger), kept on its event loop.
A `Ticket` follows one accepted request; `release()` (also on garbage collection, for a
stream whose body never ran) returns its place.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from deploy.openai_api.errors import OpenAIError
from scheduler.validation import check_real


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting: int = 256          # per model: accepted, no first token yet
    max_active: int = 1024          # all models: accepted and not finished
    ttft_slo_multiple: float = 1.0  # refuse when predicted TTFT > this x the TTFT SLO; 0 = never predict
    rate_window: int = 64           # first-token intervals the rate is measured over
    cold_waiting: int = 16          # per model, until its first-token rate is measured (see above)
    adaptive: bool = True           # the AIMD limit on requests in flight (see above); False: max_active only
    initial_active: int = 64        # the adaptive limit at start (at most max_active)
    min_active: int = 4             # the adaptive limit never goes below this
    limit_decrease: float = 0.5     # the adaptive limit's factor at a late first token

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_active", "rate_window", "cold_waiting", "initial_active", "min_active"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if check_real("ttft_slo_multiple", self.ttft_slo_multiple) < 0:
            raise ValueError(f"ttft_slo_multiple must be >= 0, got {self.ttft_slo_multiple!r}")
        if not 0 < check_real("limit_decrease", self.limit_decrease) < 1:
            raise ValueError(f"limit_decrease must be in (0, 1), got {self.limit_decrease!r}")


def overloaded(message: str, retry_after_s: float) -> OpenAIError:
    seconds = max(1, math.ceil(retry_after_s))
    return OpenAIError(429, f"{message}; retry after {seconds} s", type="requests", code="rate_limit_exceeded",
                       headers={"Retry-After": str(seconds)})


RECENT = 16   # first-token intervals of the recent rate


def _per_second(intervals) -> float:
    total = sum(intervals)
    return math.inf if total <= 0 else len(intervals) / total


class _ModelQueue:
    def __init__(self, window: int) -> None:
        self.waiting = 0
        self.intervals: deque[float] = deque(maxlen=window)   # seconds between first tokens, queue standing
        self.last_first: float | None = None                  # time of the last first token, queue standing

    def rate(self) -> float | None:
        """First tokens per second while a queue stands; None until a few were seen. The lower
        of the whole window's rate and the latest RECENT intervals': when overload slows the
        cluster (on a small host the edge's own work takes the workers' CPU), the recent rate
        falls first, and admitting at the old one would promise starts the cluster no longer makes."""
        if len(self.intervals) < 4:
            return None
        return min(_per_second(self.intervals), _per_second(list(self.intervals)[-RECENT:]))

    def first_token(self, now: float) -> None:
        self.waiting -= 1
        if self.last_first is not None:
            self.intervals.append(now - self.last_first)
        self.last_first = now if self.waiting > 0 else None

    def left_waiting(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.last_first = None


class Admission:
    def __init__(self, config: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or AdmissionConfig()
        self.clock = clock
        self.active = 0
        self.rejected = 0
        self._queues: dict[str, _ModelQueue] = {}
        c = self.config
        # the adaptive limit on self.active, and when it was last lowered
        self.limit = float(min(c.initial_active, c.max_active) if c.adaptive else c.max_active)
        self._lowered_at = -math.inf
        self._deadlines: list[tuple[float, int, Ticket]] = []   # accepted, by first-token deadline
        self._seq = itertools.count()

    def _expire(self) -> None:
        """A request still without its first token at its deadline is late now, not when its token
        comes: the limit reacts a whole SLO sooner (the chaos bench's tail was those seconds)."""
        now = self.clock()
        while self._deadlines:
            deadline, _, ticket = self._deadlines[0]
            if ticket.waiting and deadline >= now:
                return
            heapq.heappop(self._deadlines)
            if ticket.waiting:
                ticket.late = True
                self.started(True, ticket.admitted_at)

    def limit_now(self) -> int:
        """Requests in flight this edge takes now (the adaptive limit, within max_active)."""
        return max(1, min(self.config.max_active, int(self.limit)))

    def check_room(self) -> None:
        """Raise the 429 for a full edge, before anything of the request is read."""
        self._expire()
        if self.active >= self.limit_now():
            self.rejected += 1
            raise self._full()

    def _full(self) -> OpenAIError:
        limit = self.limit_now()
        why = "" if limit >= self.config.max_active else " (lowered while recent requests started late)"
        return overloaded(f"the server is at its limit of {limit} requests in flight{why}", 1.0)

    def started(self, late: bool, admitted_at: float) -> None:
        """A request's first token came, `late` or not (against its TTFT SLO from arrival): the
        adaptive limit halves at the first late one admitted under the current limit, and grows
        by one for one on time while at least half of it is in use."""
        c = self.config
        if not c.adaptive:
            return
        if late:
            if admitted_at >= self._lowered_at:
                self.limit = max(float(c.min_active), min(self.limit, self.active) * c.limit_decrease)
                self._lowered_at = self.clock()
        elif 2 * self.active >= self.limit:   # in use: a limit twice what is used grows no more
            self.limit = min(float(c.max_active), self.limit + 1)

    def waiting(self, model: str) -> int:
        q = self._queues.get(model)
        return 0 if q is None else q.waiting

    def predicted_ttft_s(self, model: str) -> float | None:
        """Predicted TTFT of a request for `model` accepted now; None when there is no estimate."""
        q = self._queues.get(model)
        rate = None if q is None else q.rate()
        return None if rate is None else (q.waiting + 1) / rate

    def check(self, model: str, ttft_slo_s: float) -> None:
        """Raise the 429 that `admit` would raise now, taking nothing: the ingress asks before it
        tokenises, so that under overload a refusal costs the edge no tokenising (a thread hop
        and the tokenizer's work, for most requests when most are refused)."""
        q = self._queues.get(model)   # a model never admitted has no queue to refuse on (none is made)
        self._refuse_if_full(model, ttft_slo_s, q or _ModelQueue(self.config.rate_window))

    def admit(self, model: str, ttft_slo_s: float, arrived_at: float | None = None,
              late_after_s: float | None = None) -> Ticket:
        """A ticket for a request accepted now, or OpenAIError 429. arrived_at: when the edge began
        reading the request (this admission's clock; default now), what its lateness counts from;
        late_after_s: how long after it its first token is late (default its TTFT SLO; the ingress
        gives the larger of it and the server's, so a client asking for 1 ms lowers no limit)."""
        q = self._queues.setdefault(model, _ModelQueue(self.config.rate_window))
        self._refuse_if_full(model, ttft_slo_s, q)
        q.waiting += 1
        self.active += 1
        now = self.clock()
        late_after_s = ttft_slo_s if late_after_s is None else late_after_s
        ticket = Ticket(self, q, (now if arrived_at is None else arrived_at) + late_after_s, now)
        if self.config.adaptive:
            heapq.heappush(self._deadlines, (ticket.deadline, next(self._seq), ticket))
        return ticket

    def _refuse_if_full(self, model: str, ttft_slo_s: float, q: "_ModelQueue") -> None:
        c = self.config
        self.check_room()
        rate = q.rate()
        drain_s = (lambda n: n / rate) if rate else (lambda n: 1.0)
        if q.waiting >= c.max_waiting:
            self.rejected += 1
            raise overloaded(f"model '{model}' has {q.waiting} requests waiting to start (its limit)",
                             drain_s(q.waiting - c.max_waiting + 1))
        if rate is None and c.ttft_slo_multiple > 0 and q.waiting >= min(c.cold_waiting, c.max_waiting):
            self.rejected += 1
            raise overloaded(f"model '{model}' has {q.waiting} requests waiting to start and no measured start "
                             "rate yet", 1.0)
        predicted = (q.waiting + 1) / rate if rate else None
        allowed = c.ttft_slo_multiple * ttft_slo_s
        if c.ttft_slo_multiple > 0 and predicted is not None and predicted > allowed:
            self.rejected += 1
            raise overloaded(f"model '{model}' would start this request in about {predicted:.1f} s, over "
                             f"{c.ttft_slo_multiple:g} x its TTFT SLO of {ttft_slo_s:g} s", predicted - allowed)


class Ticket:
    """One accepted request's place: `first_token()` when output starts, `release()` at the end."""

    def __init__(self, admission: Admission, queue: _ModelQueue, deadline: float, admitted_at: float) -> None:
        self._admission = admission
        self._queue = queue
        self.deadline = deadline          # the first token is late after this (admission's clock)
        self.admitted_at = admitted_at
        self.late = False                 # counted late already (its deadline passed while it waited)
        self._started = False
        self._released = False

    @property
    def waiting(self) -> bool:
        return not self._started and not self._released

    def first_token(self) -> None:
        if self.waiting:
            self._started = True
            now = self._admission.clock()
            self._queue.first_token(now)
            if not self.late:
                self._admission.started(now > self.deadline, self.admitted_at)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if not self._started:
            self._queue.left_waiting()
        self._admission.active -= 1

    def __del__(self) -> None:
        self.release()
