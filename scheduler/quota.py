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
  * c0 == 0 (every model of the round stays resident): no weights move, and alpha does not
    depend on the turns' length (each batch gets 1/N of the device whatever it is), so turns
    are short: `min_quota_steps` steps. But a turn still pays the engine a fixed cost
    `turn_cost_s` (scheduling it, emitting its frames, measured by the policy), which on a
    small model is a real share of a short turn. A turn is made long enough to keep that
    cost under `turn_overhead_frac` of it (the same amortisation K does for weight copies)
    and no longer than 1/N of the tightest TBT SLO (a round of them still fits it, so even
    a stream's first gap after its prefill meets it), at most `max_quota_steps` steps (the
    engine's multi-step run): big models keep their short turns, tiny ones get fewer.
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
    switch_factor: float | None = None, max_quota_steps: int | None = None, turn_cost_s: float = 0.0,
    turn_overhead_frac: float | None = None,
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
    if max_quota_steps is not None and max_quota_steps < 1:
        raise ValueError(f"max_quota_steps must be >= 1 or None, got {max_quota_steps!r}")
    if turn_overhead_frac is not None and not 0 < turn_overhead_frac < 1:
        raise ValueError(f"turn_overhead_frac must be in (0, 1) or None, got {turn_overhead_frac!r}")
    if not turn_cost_s >= 0:
        raise ValueError(f"turn_cost_s must be >= 0, got {turn_cost_s!r}")

    n = [slo / d for slo, d in zip(tbt_slos_s, step_times_s)]
    if len(n) == 1:
        return QuotaPlan(alpha=1.0 / n[0], quotas_s=(math.inf,))
    if switch_time_s == 0:
        min_slo = min(tbt_slos_s)
        turn_s = free_turn_s(turn_cost_s, turn_overhead_frac, min_slo, len(step_times_s))
        quotas = tuple(free_switch_steps(d, turn_s, min_quota_steps, max_quota_steps) * d for d in step_times_s)
        return QuotaPlan(alpha=free_switch_alpha(sum(step_times_s), min_slo), quotas_s=quotas)
    s = sum(1.0 / x for x in n)
    alpha = switch_alpha(switch_time_s, s, min(n), quota_max_s, switch_factor)
    return QuotaPlan(alpha=alpha, quotas_s=tuple(switch_time_s / (x * (alpha - s)) for x in n))


def free_turn_s(turn_cost_s: float, turn_overhead_frac: float | None, min_tbt_slo_s: float,
                num_batches: int) -> float:
    """How long a turn should be when switches are free: enough that the engine's fixed cost
    of a turn is at most `turn_overhead_frac` of it, within 1/num_batches of the tightest TBT
    SLO (0: no such cost known, turns stay at min_quota_steps)."""
    if turn_overhead_frac is None or not turn_cost_s > 0:
        return 0.0
    return min(turn_cost_s / turn_overhead_frac, min_tbt_slo_s / num_batches)


def free_switch_steps(step_s: float, turn_s: float, min_quota_steps: int, max_quota_steps: int | None) -> int:
    """Steps of a turn of about `turn_s` (whole steps that fit), between min_quota_steps and
    max_quota_steps (None: min_quota_steps)."""
    if max_quota_steps is None or max_quota_steps <= min_quota_steps:
        return min_quota_steps
    return max(min_quota_steps, min(max_quota_steps, int(turn_s / step_s)))


def free_switch_alpha(round_step_s: float, min_tbt_slo_s: float) -> float:
    """alpha of a round whose switches are free: each batch emits one token per `round_step_s`
    (the sum of the batches' step times) whatever the turns' length, so the tightest SLO decides."""
    return round_step_s / min_tbt_slo_s


def switch_alpha(switch_time_s: float, sum_inv_n: float, min_n: float, quota_max_s: float,
                 switch_factor: float | None) -> float:
    """The rule's alpha from a round's sums: c0, S = sum_j 1/n_j and min_i n_i (docstring above)."""
    if switch_factor is not None:
        quota_max_s = min(quota_max_s, switch_factor * switch_time_s)
    return max(switch_time_s / (min_n * quota_max_s) + sum_inv_n, 0.5)
