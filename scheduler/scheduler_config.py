"""SchedulerConfig: the knobs every scheduling policy reads, checked once at construction."""
from __future__ import annotations

from dataclasses import dataclass

import scheduler.deadlines as deadlines
from scheduler.quota import QUOTA_MAX_S, QUOTA_SWITCH_FACTOR


@dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_group: int = 8  # requests of one model prefilled as a group (amortises a switch)
    max_prefill_tokens: int = 8192  # token budget of one prefill step (one request may exceed it)
    max_batch_size: int = 256  # requests in one decode step
    quota_max_s: float = QUOTA_MAX_S  # Q_max of the quota rule
    min_quota_steps: int = 4  # decode steps per turn when switches are free (all resident)
    quota_switch_factor: float | None = QUOTA_SWITCH_FACTOR  # cap quotas at this x the round's switch cost (None: Q_max only)
    overload_control: bool = True  # alpha > 1: serve the batches that fit, hold the rest (token-level)
    # token-level: a switch to a model with no decode batch waits while every waiting request can
    # still make its TTFT (scheduler/ttft_slack.py); False: the quota rule alone (an ablation)
    ttft_slack: bool = True
    # what the SLO promises of a stream's tokens after its first (scheduler/deadlines.py):
    # "mean_tpot" (goodput: mean TPOT from the first token) or "per_token" (Aegaeon's deadlines,
    # arrival + TTFT + k x TBT; the planner's strict measure). Token-level plans by it.
    slo_measure: str = "mean_tpot"
    # split a prompt whose prefill exceeds a round's prefill budget while streams decode (token-level)
    chunked_prefill: bool = True
    # token-level, all resident, room to spare (alpha <= 0.5): quotas run in slices round-robin
    # and prefill is spread between them (smoother streams; TTFT and throughput pay for it)
    smooth_streams: bool = False
    # overload control admits new requests while the next round's alpha <= this (None: by the
    # measure, see `admission_alpha` below)
    admission_alpha: float | None = None
    max_decode_steps: int = 8  # decode steps the engine may run back to back per schedule call (1: one)
    # all resident: turns (up to max_decode_steps) long enough that a turn's fixed engine cost
    # is at most this share of it (None: min_quota_steps; see scheduler/quota.py)
    turn_overhead_frac: float | None = 0.02

    def __post_init__(self) -> None:
        for name in ("max_prefill_group", "max_prefill_tokens", "max_batch_size", "min_quota_steps",
                     "max_decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if not self.quota_max_s > 0:
            raise ValueError(f"SchedulerConfig.quota_max_s must be > 0, got {self.quota_max_s!r}")
        if self.admission_alpha is not None and not 0 < self.admission_alpha <= 1:
            raise ValueError(f"SchedulerConfig.admission_alpha must be in (0, 1] or None, got {self.admission_alpha!r}")
        for name in ("overload_control", "ttft_slack", "chunked_prefill", "smooth_streams"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.slo_measure not in deadlines.MEASURES:
            raise ValueError(f"SchedulerConfig.slo_measure must be one of {', '.join(deadlines.MEASURES)}, "
                             f"got {self.slo_measure!r}")
        if self.turn_overhead_frac is not None and not 0 < self.turn_overhead_frac < 1:
            raise ValueError(f"SchedulerConfig.turn_overhead_frac must be in (0, 1) or None, "
                             f"got {self.turn_overhead_frac!r}")
        if self.quota_switch_factor is not None and not self.quota_switch_factor > 0:
            raise ValueError(f"SchedulerConfig.quota_switch_factor must be > 0 or None, "
                             f"got {self.quota_switch_factor!r}")

    @property
    def per_token(self) -> bool:
        """Does the SLO promise per-token deadlines (arrival + TTFT + k x TBT), not mean TPOT?"""
        return self.slo_measure == "per_token"


def admission_alpha(config: SchedulerConfig) -> float:
    """The alpha a round may reach with a new batch admitted: `config.admission_alpha`, else by
    the measure: 0.6 under mean TPOT and 1.0 under per-token deadlines (a stream's first token
    banks a reserve of its TTFT, scheduler/ttft_slack.py, which is the headroom there).

    Under mean TPOT no stream has slack to absorb a misestimated round, and past capacity the
    prefill budget (overload.py) stretches a round's mean TBT from alpha to the SLO itself; at
    0.9, token-level's streams ran at 41-49 ms against a 46.4 ms SLO on the bursty load test
    past capacity, and most requests that made their TTFT missed their mean TPOT. At 0.6 the
    rounds hold fewer models, each stream keeps a margin, and the prefill budget (T0 x (1 /
    alpha - 1)) is larger, so the hot models' arrivals join their running batches on time
    (issue 42, docs/benchmarks.md "Pace past capacity")."""
    if config.admission_alpha is not None:
        return config.admission_alpha
    return 1.0 if config.per_token else 0.6
