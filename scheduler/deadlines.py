"""When a request's next token is due, and which requests are past saving (overload.py's slack).

A waiting request's first token is due by arrival + TTFT. A stream's token k after its first is
due by one of two measures (`SchedulerConfig.slo_measure`):

- "mean_tpot" (goodput, as vLLM's benchmark and the load test score): by first + k x TBT, its
  mean-TPOT budget, which a fast first token does not widen;
- "per_token" (Aegaeon's per-token deadlines, the planner's strict and cumulative measures): by
  arrival + TTFT + k x TBT, so a first token that came early banks its lead for the stream.

Time a stream has banked by running ahead of that is its slack. Overload control
(scheduler/overload.py) orders batches by it; a waiting request already late goes last, behind
every request still on time, its model's own included (`serving_order`): it has missed its
TTFT under either measure, so serving it first saves nothing and costs an on-time request.

A turn's end leaves a stream waiting for a gap (the rest of the round) before its next token.
Two helpers size a turn so that gap does not cost a stream its SLO (docs/design.md, "Turns
that keep each stream's pace"): `finishing_steps` (a stream a few tokens from its end finishes
now rather than after the gap) and `catch_up_steps` (a stream behind its pace gets the steps
that put it back ahead of the gap).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from scheduler.request import Request

# A late waiting request once went back to the front when late by LATE_AGE x its TTFT SLO
# (3.0; 0.5 before that). Past capacity the queue then held hundreds of such requests, served
# oldest first, every one late: on the bursty load test at 9.6 req/s (12 models, 1 worker)
# token-level's goodput was 0.036 against request-level's 0.170, its TTFT p50 8-16 s
# (docs/benchmarks.md, "Late requests last"). Late ones now wait until no on-time one does.
STALL_AGE = 0.5  # a lost stream with no token for (1 + STALL_AGE) x its TTFT SLO is aged


MEASURES = ("mean_tpot", "per_token")


def _stream_origin(request: Request, per_token: bool) -> float:
    """When a stream's token 0 is due by its measure; token k is due k x TBT later."""
    if per_token:
        return request.arrival_time + request.slo.ttft_s
    return request.first_token_time


def slack(request: Request, now: float, per_token: bool = False) -> float:
    """Until the request's next token is due (negative: late)."""
    if request.first_token_time is None:
        return request.arrival_time + request.slo.ttft_s - now
    return _stream_origin(request, per_token) + request.num_output_tokens * request.slo.tbt_s - now


def last_slack(request: Request, now: float, step_s: float, per_token: bool = False) -> float:
    """A stream's laxity were it to run to max_tokens: its last token is due at origin +
    (max_tokens - 1) * TBT, and its remaining tokens take `step_s` each at full speed.
    inf for a request with no token yet (not a stream)."""
    if request.first_token_time is None:
        return math.inf
    n = request.sampling_params.max_tokens
    left = n - request.num_output_tokens
    return _stream_origin(request, per_token) + (n - 1) * request.slo.tbt_s - now - left * step_s


def lost(request: Request, now: float, step_s: float, per_token: bool = False) -> bool:
    """A stream whose mean TPOT misses whatever the rounds do from now: late at full speed
    (`step_s` a token) whether it ends with its next token or at max_tokens. Its laxity is
    linear in where it ends, so those two are its best cases. Never a request with no token
    yet (its `last_slack` is inf)."""
    return max(slack(request, now, per_token) - step_s, last_slack(request, now, step_s, per_token)) < 0


def stalled(request: Request, now: float) -> bool:
    """A stream with no token for (1 + STALL_AGE) x its TTFT SLO: a lost batch of such is aged."""
    return bool(request.token_times) and now - request.token_times[-1] > (1.0 + STALL_AGE) * request.slo.ttft_s


def goes_last(request: Request, now: float) -> bool:
    """A waiting request already late: it yields to every request still on time."""
    return slack(request, now) < 0


def serving_order(queue: Iterable[Request], now: float, limit: int | None = None) -> list[Request]:
    """A model's waiting requests in the order overload control prefills them: a split prefill
    first (it holds the blocks of its whole prompt), then those still on time by TTFT deadline,
    then the late ones, oldest first. FIFO put the on-time arrivals of a model with a backlog
    behind its late requests, so past capacity none of its requests made its TTFT.

    `limit`: only the first `limit` of them (the same list's head, without sorting a backlog
    of hundreds on every scheduling step for a prefill group of a few)."""
    def key(r: Request) -> tuple:
        return not r.block_ids, goes_last(r, now), r.arrival_time + r.slo.ttft_s

    return sorted(queue, key=key) if limit is None else heapq.nsmallest(limit, queue, key=key)


def tokens_left(request: Request) -> int:
    """Tokens the request may still emit (max_tokens less those it has)."""
    return request.sampling_params.max_tokens - request.num_output_tokens


def finishing_steps(streams: Iterable[Request], now: float, step_s: float, gap_s: float, most: int,
                    per_token: bool = False) -> int:
    """The fewest steps (at most `most`) that end a stream on time which would miss its SLO
    were it to wait `gap_s` first, or 0: its last token at full speed from now is on time
    (`last_slack` >= 0), but not after the gap."""
    best = 0
    for r in streams:
        left = tokens_left(r)
        if r.first_token_time is None or not 0 < left <= most:
            continue
        laxity = last_slack(r, now, step_s, per_token)
        if laxity >= 0 > laxity - gap_s and (not best or left < best):
            best = left
    return best


def catch_up_steps(streams: Iterable[Request], now: float, step_s: float, gap_s: float, turn_steps: float,
                   per_token: bool = False) -> float:
    """Steps beyond `turn_steps` a batch needs for each of its streams that goes on past the
    turn to have its next token on time after `gap_s` (0: none). A step gains a stream its
    TBT SLO less the step (its next token is due a TBT later), so a stream short of
    gap + step of slack needs (gap + step - slack) / (TBT - step) steps; a lost stream
    (`lost`) needs none, and none needs more than its tokens left."""
    need = 0.0
    for r in streams:
        left = tokens_left(r)
        gain = r.slo.tbt_s - step_s
        if r.first_token_time is None or left <= turn_steps or gain <= 0 or lost(r, now, step_s, per_token):
            continue
        steps = (gap_s + step_s - slack(r, now, per_token)) / gain
        need = max(need, min(steps, left) - turn_steps)
    return need
