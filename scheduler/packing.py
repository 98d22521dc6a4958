"""SLO-aware packing: which models share a worker, so that their decode rounds fit their SLOs.

A token-level worker serves its models' decode batches in rounds (scheduler/token_level.py,
quotas from scheduler/quota.py). Whether those rounds meet every model's TBT SLO depends on
the set of models the worker holds, so placement chooses the sets. Estimates, from demand
(requests in flight, Little's law) and per-model costs, for one replica of model m that
shares the model's demand D with r - 1 others:

    b       = D / r                    requests in flight on this replica
    p       = 1 - exp(-b)              chance it has any (Poisson): it takes part in rounds
    d(x)    = d0 + d1 * x              decode step at batch x
    decode  = (p * d0 + d1 * b) / TBT  device share its decode needs for one token per TBT
                                       (p * d(b/p) / TBT: b/p is its batch while active)
    prefill = rate / r * prefill_s     device share of its prefills
    n       = TBT / d(b/p)             decode steps per TBT budget: the quota rule's n_i

and for a worker with k weight slots holding a set of replicas:

    S, P    sums of decode and prefill shares
    c0      switch time of a round. A round swaps in each active model when more models are
            active than slots hold: c0 = cbar * E[N 1{N > k}], N the number of active
            models (a Poisson binomial over the p's), cbar their p-weighted mean switch time.
            With at most k models, or few enough active, c0 = 0: all stay resident.
    X       = c0 / (min n * Q), Q = min(Q_max, K * c0): the quota rule's switch term, so
            that alpha = max(S + X, 0.5) is the predicted mean TBT / TBT SLO
    share   = S + X on a decode worker, S + X + P on a mixed one, P + prefill switches
              (a group of a model that is not resident pays a swap) on a prefill worker
    round   = c0 * alpha / (alpha - S): how long a model waits between its turns

The set fits when share <= max_load (alpha stays below 1 with headroom for bursts) and the
round stays within `round_ttft_frac` of the smallest TTFT SLO of the set: a request that
arrives mid-round waits for its model's next turn, so long rounds break TTFT and the mean
TBT of short requests even when alpha <= 1.

`pack` places each model's replicas, heaviest first: previous workers are kept while the
set still fits (sticky), then the least-loaded worker that fits takes the next replica
(preferring one whose node's host cache has the model, then fewer models); when none
fits, its previous worker keeps it if it had one (moving would not help), else the
least-loaded one takes it (the fleet is too small; never leave a model unserved). Every worker holds at most `max_models_per_worker` models. A previous
assignment stays while its set is within the limits times `sticky_slack`, so estimates
that wobble around a limit do not move models back and forth.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from scheduler.quota import QUOTA_MAX_S, QUOTA_SWITCH_FACTOR

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class PackLimits:
    max_load: float = 0.9
    round_ttft_frac: float = 0.5
    max_models_per_worker: int = 32
    quota_max_s: float = QUOTA_MAX_S                    # the scheduler's Q_max (SchedulerConfig)
    quota_switch_factor: float | None = QUOTA_SWITCH_FACTOR     # the scheduler's K (SchedulerConfig)
    sticky_slack: float = 1.25                  # a previous assignment stays while within limits x this

    def __post_init__(self) -> None:
        if not self.sticky_slack >= 1:
            raise ValueError(f"sticky_slack must be >= 1, got {self.sticky_slack!r}")
        if not self.max_load > 0:
            raise ValueError(f"max_load must be > 0, got {self.max_load!r}")
        if not self.round_ttft_frac > 0:
            raise ValueError(f"round_ttft_frac must be > 0, got {self.round_ttft_frac!r}")
        if self.max_models_per_worker < 1:
            raise ValueError(f"max_models_per_worker must be >= 1, got {self.max_models_per_worker!r}")
        if not self.quota_max_s > 0:
            raise ValueError(f"quota_max_s must be > 0, got {self.quota_max_s!r}")


@dataclass(frozen=True)
class ModelCost:
    """What packing knows of one model: its step costs on a worker and its SLO."""

    decode_step_s: float             # d0: one decode step, batch of 1
    decode_step_per_request_s: float  # d1: added per request in the batch (with its context)
    prefill_s: float                 # one typical prompt
    switch_s: float                  # its weights into a slot from the host cache
    tbt_s: float
    ttft_s: float

    def __post_init__(self) -> None:
        if not self.decode_step_s > 0 or not self.tbt_s > 0 or not self.ttft_s > 0:
            raise ValueError(f"decode_step_s, tbt_s and ttft_s must be > 0, got {self!r}")
        if self.decode_step_per_request_s < 0 or self.prefill_s < 0 or self.switch_s < 0:
            raise ValueError(f"per-request, prefill and switch costs must be >= 0, got {self!r}")


@dataclass(frozen=True)
class Replica:
    """What one replica of a model asks of the worker that holds it."""

    model: str
    p_active: float
    decode_share: float
    prefill_share: float
    rate: float              # arrivals per second on this replica
    switch_s: float
    steps_per_tbt: float
    ttft_s: float


def replica(model: str, cost: ModelCost, demand: float, rate: float, replicas: int = 1) -> Replica:
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas!r}")
    if demand < 0 or rate < 0:
        raise ValueError(f"demand and rate must be >= 0, got {demand!r}, {rate!r}")
    b = demand / replicas
    p = -math.expm1(-b)
    active_batch = b / p if p > 0 else 1.0
    step = cost.decode_step_s + cost.decode_step_per_request_s * active_batch
    return Replica(
        model=model, p_active=p,
        decode_share=(p * cost.decode_step_s + cost.decode_step_per_request_s * b) / cost.tbt_s,
        prefill_share=rate / replicas * cost.prefill_s, rate=rate / replicas,
        switch_s=cost.switch_s, steps_per_tbt=cost.tbt_s / step, ttft_s=cost.ttft_s)


@dataclass(frozen=True)
class WorkerLoad:
    share: float      # predicted busy share of the device
    round_s: float    # predicted wait of a model between its decode turns
    ttft_s: float     # smallest TTFT SLO of the set (inf when empty)

    def fits(self, limits: PackLimits, slack: float = 1.0) -> bool:
        return (self.share <= limits.max_load * slack + 1e-12
                and self.round_s <= limits.round_ttft_frac * slack * self.ttft_s)


class _State(NamedTuple):
    active: tuple[float, ...]   # P(N = j) for j = 0..k, N = number of active models
    sum_p: float                # E[N]
    sum_pc: float               # sum of p x switch time
    decode: float               # S
    prefill: float              # P
    rate_switch: float          # sum of arrival rate x switch time (prefill groups' swaps)
    min_n: float
    ttft_s: float
    count: int


class WorkerBin:
    """The replicas packing has put on one worker; `load_with` prices one more in O(slots)."""

    def __init__(self, worker_id: str, num_slots: int, role: str, limits: PackLimits):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots!r}")
        self.worker_id, self.num_slots, self.role, self.limits = worker_id, num_slots, role, limits
        self.models: list[str] = []
        self._state = _State((1.0,) + (0.0,) * num_slots, 0.0, 0.0, 0.0, 0.0, 0.0, math.inf, math.inf, 0)
        self.load = WorkerLoad(0.0, 0.0, math.inf)

    def __len__(self) -> int:
        return len(self.models)

    def holds(self, model: str) -> bool:
        return model in self.models

    def load_with(self, rep: Replica) -> WorkerLoad:
        return self._evaluate(self._with(rep))

    def add(self, rep: Replica) -> None:
        self._state = self._with(rep)
        self.models.append(rep.model)
        self.load = self._evaluate(self._state)

    def _with(self, rep: Replica) -> _State:
        s, p = self._state, rep.p_active
        active = (s.active[0] * (1 - p),) + tuple(
            s.active[j] * (1 - p) + s.active[j - 1] * p for j in range(1, self.num_slots + 1))
        return _State(active, s.sum_p + p, s.sum_pc + p * rep.switch_s, s.decode + rep.decode_share,
                      s.prefill + rep.prefill_share, s.rate_switch + rep.rate * rep.switch_s,
                      min(s.min_n, rep.steps_per_tbt) if p > 0 else s.min_n, min(s.ttft_s, rep.ttft_s),
                      s.count + 1)

    def _evaluate(self, s: _State) -> WorkerLoad:
        k, limits = self.num_slots, self.limits
        if self.role == "prefill":
            # A prefill group of a model that is not resident pays its swap-in.
            miss = 0.0 if s.count <= k else 1.0 - k / s.count
            return WorkerLoad(s.prefill + miss * s.rate_switch, 0.0, s.ttft_s)
        # E[N 1{N > k}] = E[N] - sum_{j <= k} j P(N = j); exactly 0 with at most k models.
        overflow = 0.0 if s.count <= k else max(0.0, s.sum_p - sum(j * s.active[j] for j in range(1, k + 1)))
        c0 = s.sum_pc / s.sum_p * overflow if s.sum_p > 0 else 0.0
        if c0 > 1e-12 and math.isfinite(s.min_n):
            q = limits.quota_max_s if limits.quota_switch_factor is None else min(
                limits.quota_max_s, limits.quota_switch_factor * c0)
            x = c0 / (s.min_n * q)
            alpha = max(s.decode + x, 0.5)
            round_s = c0 * alpha / (alpha - s.decode) if alpha > s.decode else math.inf
        else:
            x, round_s = 0.0, 0.0
        return WorkerLoad(s.decode + x + (s.prefill if self.role == "mixed" else 0.0), round_s, s.ttft_s)


@dataclass(frozen=True)
class PackItem:
    model: str
    replicas: int
    load: Replica                          # per replica
    fits_on: frozenset[str]                # workers whose slots hold its weights
    sticky: tuple[str, ...] = ()           # its workers in the previous plan
    cached_on: frozenset[str] = frozenset()  # workers whose node's host cache has it


def replicas_needed(model: str, cost: ModelCost, demand: float, rate: float, max_replicas: int,
                    role: str, limits: PackLimits, max_per_replica: float = math.inf) -> int:
    """Fewest replicas (<= max_replicas) a lone replica of which fits a worker of `role`,
    with at most `max_per_replica` requests in flight on each."""
    for r in range(1, max(1, max_replicas) + 1):
        if demand / r > max_per_replica:
            continue
        probe = WorkerBin("probe", 1, role, limits)
        if probe.load_with(replica(model, cost, demand, rate, r)).fits(limits):
            return r
    return max(1, max_replicas)


def pack(bins: Sequence[WorkerBin], items: Iterable[PackItem]) -> dict[str, list[str]]:
    """Model -> workers, by the rule in the module docstring. A model that no worker can
    take (every worker that fits it is full) maps to []."""
    by_id = {b.worker_id: b for b in bins}
    items = sorted(items, key=lambda it: (-_alone(it, bins), it.model))
    chosen: dict[str, list[str]] = {it.model: [] for it in items}
    for it in items:   # sticky first, heaviest first: nothing moves without cause
        for wid in it.sticky:
            b = by_id.get(wid)
            if len(chosen[it.model]) >= it.replicas or b is None or wid not in it.fits_on:
                continue
            if len(b) < b.limits.max_models_per_worker and b.load_with(it.load).fits(b.limits, b.limits.sticky_slack):
                b.add(it.load)
                chosen[it.model].append(wid)
    for it in items:
        while len(chosen[it.model]) < it.replicas:
            cands = [b for b in bins if b.worker_id in it.fits_on and not b.holds(it.model)
                     and len(b) < b.limits.max_models_per_worker]
            if not cands:
                break
            priced = [(b.load_with(it.load), b) for b in cands]
            fitting = [(lw, b) for lw, b in priced if lw.fits(b.limits)]
            stayed = [(lw, b) for lw, b in priced if b.worker_id in it.sticky]
            if fitting:
                _, best = min(fitting, key=lambda lb: (round(lb[0].share, 9), lb[1].worker_id not in it.cached_on,
                                                       len(lb[1]), lb[1].worker_id))
            elif stayed:   # overcommitted everywhere: moving would not help, so it stays
                _, best = stayed[0]
            else:          # overcommitted: the least-loaded worker takes it
                _, best = min(priced, key=lambda lb: (round(lb[0].share, 9), lb[0].round_s, len(lb[1]),
                                                      lb[1].worker_id))
            best.add(it.load)
            chosen[it.model].append(best.worker_id)
    return chosen


def _alone(it: PackItem, bins: Sequence[WorkerBin]) -> float:
    role = bins[0].role if bins else "mixed"
    probe = WorkerBin("probe", 1, role, bins[0].limits if bins else PackLimits())
    return probe.load_with(it.load).share


def loads(bins: Iterable[WorkerBin]) -> Mapping[str, WorkerLoad]:
    return {b.worker_id: b.load for b in bins}
