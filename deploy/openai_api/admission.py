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

A refusal is a 429 in OpenAI's shape with `Retry-After` (seconds until the queue ahead is
predicted to be short enough, at least 1): the openai SDK retries it on its own. Counts are
per ingress replica (with R replicas the bounds are R times larger), kept on its event loop.
A `Ticket` follows one accepted request; `release()` (also on garbage collection, for a
stream whose body never ran) returns its place.
"""
from __future__ import annotations

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

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_active", "rate_window", "cold_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if check_real("ttft_slo_multiple", self.ttft_slo_multiple) < 0:
            raise ValueError(f"ttft_slo_multiple must be >= 0, got {self.ttft_slo_multiple!r}")


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

    def admit(self, model: str, ttft_slo_s: float) -> Ticket:
        """A ticket for a request accepted now, or OpenAIError 429."""
        q = self._queues.setdefault(model, _ModelQueue(self.config.rate_window))
        self._refuse_if_full(model, ttft_slo_s, q)
        q.waiting += 1
        self.active += 1
        return Ticket(self, q)

    def _refuse_if_full(self, model: str, ttft_slo_s: float, q: "_ModelQueue") -> None:
        c = self.config
        rate = q.rate()
        drain_s = (lambda n: n / rate) if rate else (lambda n: 1.0)
        if self.active >= c.max_active:
            self.rejected += 1
            raise overloaded(f"the server is at its limit of {c.max_active} requests in flight", 1.0)
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

    def __init__(self, admission: Admission, queue: _ModelQueue) -> None:
        self._admission = admission
        self._queue = queue
        self._started = False
        self._released = False

    def first_token(self) -> None:
        if not self._started and not self._released:
            self._started = True
            self._queue.first_token(self._admission.clock())

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if not self._started:
            self._queue.left_waiting()
        self._admission.active -= 1

    def __del__(self) -> None:
        self.release()
