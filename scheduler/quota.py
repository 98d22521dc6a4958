"""Aegaeon's decode quota rule, as a pure function.

Decode batches of different models take turns on one device, in rounds. Batch i runs
for its quota q_i, then the device switches to the next batch. Derivation:

  d_i    predicted decode step time of batch i; TBT_i its time-between-tokens SLO
  n_i    = TBT_i / d_i, how many steps of batch i fit in one TBT budget
  c0     sum of the switch times paid in one round
  T      = c0 + sum_j q_j, the length of a round

  In a round batch i emits q_i / d_i tokens, so its mean TBT is T * d_i / q_i. Asking every
  batch for the same fraction alpha of its SLO, T * d_i / q_i = alpha * TBT_i = alpha * n_i * d_i,
  gives q_i = T / (alpha * n_i). Summing over i: T - c0 = (T / alpha) * S with S = sum_j 1/n_j,
  so T = c0 * alpha / (alpha - S) and

      q_i = c0 / (n_i * (alpha - S))          (needs alpha > S)

  The largest quota belongs to the smallest n_i; capping it at Q_max gives
  alpha >= c0 / (min_i n_i * Q_max) + S. Going below alpha = 0.5 buys nothing a user
  notices (tokens already come twice as fast as promised) and only multiplies switches, so

      alpha = max(c0 / (min_i n_i * Q_max) + S, 0.5)

  and every batch then sees mean TBT = alpha * TBT_i. alpha > 1 means the device is
  overloaded: the SLOs cannot all be met, but the rule still shares the device fairly.

Q_max when switches are cheap. Aegaeon fixes Q_max = 4 s for GPUs where a switch costs
about a second. A quota only needs to be long enough to amortise the round's switches;
past that it just lengthens the round, and every other batch stalls for the whole round.
With `switch_factor` K the cap becomes min(Q_max, K * c0): then alpha >= 1/(K * min_i n_i) + S,
so switching takes at most 1/(K * min_i n_i * alpha) of the device (about 5% for K = 8,
n = 5, alpha = 0.5), while a round stays a small multiple of c0. With expensive switches
K * c0 exceeds Q_max and the rule is Aegaeon's unchanged.

Two corner cases the formula does not cover:
  * c0 == 0 (every model of the round stays resident): switches are free, so short turns
    cost nothing; each batch gets `min_quota_steps` steps.
  * one batch alone: nothing to switch to; it runs until other work arrives (quota = inf).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# The rule's defaults, shared by SchedulerConfig (the engine) and PackLimits/PlacementConfig
# (placement prices a worker's rounds with the same quotas the engine will grant).
QUOTA_MAX_S = 4.0            # Q_max
QUOTA_SWITCH_FACTOR = 8.0    # K: quotas capped at K x the round's switch cost


@dataclass(frozen=True)
class QuotaPlan:
    alpha: float  # mean TBT of each batch / its TBT SLO
    quotas_s: tuple[float, ...]  # time quota per batch, same order as the inputs


def decode_quotas(
    tbt_slos_s, step_times_s, switch_time_s: float, quota_max_s: float, min_quota_steps: int = 4,
    switch_factor: float | None = None,
) -> QuotaPlan:
    """Quotas of the decode batches of one round (see the module docstring for the rule)."""
    tbt_slos_s = [float(x) for x in tbt_slos_s]
    step_times_s = [float(x) for x in step_times_s]
    if not tbt_slos_s or len(tbt_slos_s) != len(step_times_s):
        raise ValueError(
            f"need one TBT SLO per step time, got {len(tbt_slos_s)} SLOs and {len(step_times_s)} step times"
        )
    if any(not x > 0 for x in tbt_slos_s + step_times_s):
        raise ValueError("TBT SLOs and step times must be > 0")
    if not switch_time_s >= 0:
        raise ValueError(f"switch_time_s must be >= 0, got {switch_time_s!r}")
    if not quota_max_s > 0:
        raise ValueError(f"quota_max_s must be > 0, got {quota_max_s!r}")
    if min_quota_steps < 1:
        raise ValueError(f"min_quota_steps must be >= 1, got {min_quota_steps!r}")
    if switch_factor is not None and not switch_factor > 0:
        raise ValueError(f"switch_factor must be > 0 or None, got {switch_factor!r}")

    n = [slo / d for slo, d in zip(tbt_slos_s, step_times_s)]
    if len(n) == 1:
        return QuotaPlan(alpha=1.0 / n[0], quotas_s=(math.inf,))
    if switch_time_s == 0:
        quotas = tuple(min_quota_steps * d for d in step_times_s)
        round_s = sum(quotas)
        return QuotaPlan(alpha=free_switch_alpha(round_s, min_quota_steps, min(tbt_slos_s)), quotas_s=quotas)
    s = sum(1.0 / x for x in n)
    alpha = switch_alpha(switch_time_s, s, min(n), quota_max_s, switch_factor)
    return QuotaPlan(alpha=alpha, quotas_s=tuple(switch_time_s / (x * (alpha - s)) for x in n))


def free_switch_alpha(round_s: float, min_quota_steps: int, min_tbt_slo_s: float) -> float:
    """alpha of a round whose switches are free: each batch emits min_quota_steps tokens per
    round of `round_s`, so the tightest SLO decides."""
    return round_s / min_quota_steps / min_tbt_slo_s


def switch_alpha(switch_time_s: float, sum_inv_n: float, min_n: float, quota_max_s: float,
                 switch_factor: float | None) -> float:
    """The rule's alpha from a round's sums: c0, S = sum_j 1/n_j and min_i n_i (docstring above)."""
    if switch_factor is not None:
        quota_max_s = min(quota_max_s, switch_factor * switch_time_s)
    return max(switch_time_s / (min_n * quota_max_s) + sum_inv_n, 0.5)
