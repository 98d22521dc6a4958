"""Admission control at the HTTP edge: serve the bursts users send, refuse (429) only real
overload, and never drop what was accepted. The whole policy and its knobs are here.

A request is refused, with a 429 in OpenAI's shape and `Retry-After` (the openai SDK retries it
on its own), in three cases, and in no other:

1. Memory bounds. The edge serves at most `max_active` requests at once (all models), and at
   most `max_waiting` of one model wait for their first token. The Serve app sets max_active
   to its max_ongoing_requests less a few places (deploy/serve_app/app.py).
2. The cluster cannot start it in time. Its predicted TTFT, (waiting + 1) / the model's start
   rate, exceeds `ttft_slo_multiple` x its TTFT SLO (0 turns this off). The start rate is what
   the cluster is known to do:
   - measured at this edge: first tokens per second while a queue of the model stood (between
     two first tokens with requests waiting throughout; an idle server is never taken for a
     slow one), the lower of the last `rate_window` intervals' rate and the last 16's, so a
     cluster that slows under overload is seen at once;
   - until then, the engines' speed (`engine_rate(model)`, injected: the Serve app gives the
     router's view, scheduler/routing.py `start_rate`, from the step times the workers report),
     so a fresh server is not blind and takes an ordinary burst;
   - with neither (an engine that reports nothing), at most `cold_waiting` of the model wait.
3. The edge itself is overloaded (adaptive, AIMD as in TCP): the limit on requests in flight
   starts at `initial_active` (default max_active) and is cut to `limit_decrease` x the
   requests in flight when a request admitted on a *measured* start rate gets its first token
   later than its TTFT SLO (counted from when the edge began reading it; once per limit): the
   prediction said it would start in time, and the cluster or the edge did not keep it. It
   grows by one per request started on time while at least half of it is in use, never goes
   below `min_active`, and returns to its start when the edge has nothing in flight: an idle
   edge has no overload to remember. Late starts of requests admitted blind (a first burst, a
   cold server's first forwards and tokenizer loads) lower nothing: they are the ordinary
   burst, not overload. On a small host the edge's own HTTP work saturates first at 10x
   overload (`tokenmux bench chaos`): accepted streams slowed every stream and the accepted
   TTFT p99 reached 4-18x the SLO before this limit, 1.1-1.3x with it.

Each request is admitted once (`admit`), by the ingress, as soon as its model and SLO are
parsed and before it is tokenised, so a refusal costs no tokenising; a request found invalid
after that gives its place back. Counts are per ingress replica (with R replicas the bounds are
R times larger), kept on its event loop. A `Ticket` follows one accepted request; its one
owner, the engine's stream of the request (EngineClient.generate: ClusterEngineClient's
RequestState), calls `release()` once the request ends or is closed, whether or not it ever
ran; nothing is left to the garbage collector. Accepted requests are never dropped later.
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
    cold_waiting: int = 16          # per model, while neither a measured nor an engine start rate is known
    adaptive: bool = True           # the AIMD limit on requests in flight (see above); False: max_active only
    initial_active: int | None = None   # the adaptive limit at start and when idle (None: max_active)
    min_active: int = 4             # the adaptive limit never goes below this
    limit_decrease: float = 0.5     # the adaptive limit's factor at a late first token

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_active", "rate_window", "cold_waiting", "initial_active", "min_active"):
            value = getattr(self, name)
            if name == "initial_active" and value is None:
                continue
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
    def __init__(self, config: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 engine_rate: Callable[[str], float | None] | None = None) -> None:
        """engine_rate(model): requests of the model the cluster starts per second at its engines'
        known speed, or None when it does not know (see the module's docstring)."""
        self.config = config or AdmissionConfig()
        self.clock = clock
        self.engine_rate = engine_rate
        self.active = 0
        self.rejected = 0
        self._queues: dict[str, _ModelQueue] = {}
        c = self.config
        # the adaptive limit on self.active, and when it was last lowered
        self.initial_limit = float(min(c.initial_active or c.max_active, c.max_active) if c.adaptive
                                   else c.max_active)
        self.limit = self.initial_limit
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
                self.started(True, ticket)

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

    def started(self, late: bool, ticket: "Ticket") -> None:
        """A request's first token came, `late` or not (against its TTFT SLO from arrival): the
        adaptive limit is cut at the first late one admitted on a measured start rate under the
        current limit, and grows by one for one on time while at least half of it is in use."""
        c = self.config
        if not c.adaptive:
            return
        if late:
            if ticket.predicted and ticket.admitted_at >= self._lowered_at:
                self.limit = max(float(c.min_active), min(self.limit, self.active) * c.limit_decrease)
                self._lowered_at = self.clock()
        elif 2 * self.active >= self.limit:   # in use: a limit twice what is used grows no more
            self.limit = min(float(c.max_active), self.limit + 1)

    def released(self) -> None:
        """A request ended: an edge with nothing in flight forgets the overload it saw."""
        self.active -= 1
        if self.active == 0:
            self.limit = max(self.limit, self.initial_limit)

    def waiting(self, model: str) -> int:
        q = self._queues.get(model)
        return 0 if q is None else q.waiting

    def start_rate(self, model: str, q: "_ModelQueue | None" = None) -> tuple[float | None, bool]:
        """(requests of `model` started per second, whether measured here); (None, False) when
        neither this edge nor the engines know."""
        q = q or self._queues.get(model)
        measured = None if q is None else q.rate()
        if measured is not None:
            return measured, True
        known = self.engine_rate(model) if self.engine_rate is not None else None
        return (known, False) if known else (None, False)

    def predicted_ttft_s(self, model: str) -> float | None:
        """Predicted TTFT of a request for `model` accepted now; None when there is no estimate."""
        rate, _ = self.start_rate(model)
        return None if rate is None else (self.waiting(model) + 1) / rate

    def admit(self, model: str, ttft_slo_s: float, arrived_at: float | None = None,
              late_after_s: float | None = None) -> Ticket:
        """A ticket for a request accepted now, or OpenAIError 429. arrived_at: when the edge began
        reading the request (this admission's clock; default now), what its lateness counts from;
        late_after_s: how long after it its first token is late (default its TTFT SLO; the ingress
        gives the larger of it and the server's, so a client asking for 1 ms lowers no limit)."""
        q = self._queues.setdefault(model, _ModelQueue(self.config.rate_window))
        predicted = self._refuse_if_full(model, ttft_slo_s, q)
        q.waiting += 1
        self.active += 1
        now = self.clock()
        late_after_s = ttft_slo_s if late_after_s is None else late_after_s
        ticket = Ticket(self, q, (now if arrived_at is None else arrived_at) + late_after_s, now, predicted)
        if self.config.adaptive:
            heapq.heappush(self._deadlines, (ticket.deadline, next(self._seq), ticket))
        return ticket

    def _refuse_if_full(self, model: str, ttft_slo_s: float, q: "_ModelQueue") -> bool:
        """Raise the 429 for `model` now; else whether the decision rested on a measured start rate."""
        c = self.config
        self.check_room()
        rate, measured = self.start_rate(model, q)
        drain_s = (lambda n: n / rate) if rate else (lambda n: 1.0)
        if q.waiting >= c.max_waiting:
            self.rejected += 1
            raise overloaded(f"model '{model}' has {q.waiting} requests waiting to start (its limit)",
                             drain_s(q.waiting - c.max_waiting + 1))
        if rate is None and c.ttft_slo_multiple > 0 and q.waiting >= min(c.cold_waiting, c.max_waiting):
            self.rejected += 1
            raise overloaded(f"model '{model}' has {q.waiting} requests waiting to start and no known start "
                             "rate yet", 1.0)
        predicted = (q.waiting + 1) / rate if rate else None
        allowed = c.ttft_slo_multiple * ttft_slo_s
        if c.ttft_slo_multiple > 0 and predicted is not None and predicted > allowed:
            self.rejected += 1
            raise overloaded(f"model '{model}' would start this request in about {predicted:.1f} s, over "
                             f"{c.ttft_slo_multiple:g} x its TTFT SLO of {ttft_slo_s:g} s", predicted - allowed)
        return measured


class Ticket:
    """One accepted request's place: `first_token()` when output starts, `release()` at the end."""

    def __init__(self, admission: Admission, queue: _ModelQueue, deadline: float, admitted_at: float,
                 predicted: bool = False) -> None:
        self._admission = admission
        self._queue = queue
        self.deadline = deadline          # the first token is late after this (admission's clock)
        self.admitted_at = admitted_at
        self.predicted = predicted        # admitted on a start rate measured here (see Admission.started)
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
                self._admission.started(now > self.deadline, self)

    def release(self) -> None:
        """Give the place back; a second call does nothing (its owner may end and be closed)."""
        if self._released:
            return
        self._released = True
        if not self._started:
            self._queue.left_waiting()
        self._admission.released()
