"""What a run measured: per-request token times in, latency percentiles and SLO attainment out.

Times are seconds on one clock (the driver uses seconds since the start of the run, and a
token's time is when the client received it). Let a request arrive at `a` and produce
output tokens at times a + t_0, a + t_1, ..., a + t_{n-1}. Output token k (0-based) is due
at relative time d_k = TTFT_SLO + k * TBT_SLO (`scheduler.slo.SLO.deadline`).

Three measures, each a share of all requests (a failed request is a miss in all three):

**Goodput** (the headline), as vLLM's benchmark (`--goodput ttft:X tpot:Y`) and DistServe
define it: a request counts when TTFT = t_0 <= TTFT_SLO and its mean time per output token
TPOT = (t_{n-1} - t_0) / (n - 1) <= TBT_SLO (a one-token request has no TPOT: TTFT alone
decides). `attainment_goodput` is the share of requests that count and `goodput_rps` those
requests per second of run. A mid-stream stall costs only as much as it raises the mean.

**Strict attainment.** A request meets its SLO when it did not fail, produced at least one
token, and every token met its deadline: t_k <= d_k for all k. (Deadlines accumulate, so a
token may come more than TBT_SLO after its predecessor if earlier tokens came early.)
Strict attainment = meeting requests / all requests.

**Cumulative (Aegaeon) attainment**, as computed by the Aegaeon artifact
(Zyyeric/Aegaeon, plots/plot_e2e.py `compute_slo`, re-implemented here): a request's
service time [0, t_{n-1}] is cut into segments. A segment starts at s (0 at first). Token
k is on time when t_k - s <= d_k; k stays the global token index, only the origin moves.
When token k is late, the segment ends: the time credited to it is d_j of the last token j
of the segment that was on time (0 if none), and the next segment starts at s = t_k. The
last segment is credited in full, t_{n-1} - s, if its last token was on time (it is empty
otherwise, since then s = t_{n-1}). A request's attainment = credited time / t_{n-1} (1.0
when t_{n-1} = 0 and the token was on time); a failed request scores 0. Cumulative
attainment = mean over requests (unweighted). The artifact's worked example: tokens at
(3, 6, 7, 8), TTFT_SLO = 3, TBT_SLO = 2 -> credited (0, 3) and (6, 8) -> 5/8.

`strict_rps` = requests meeting the strict SLO per second of run (what `goodput_rps` used to
mean here). Per-gap TBT percentiles are a diagnostic (one stall shows in p99 however short
it is); `tpot_p*` are percentiles of the per-request mean TPOT. Failed requests are left out
of the latency percentiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from scheduler.slo import SLO

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: str
    model: str
    arrival: float  # when the request was due to be sent (open loop: its scheduled time)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    end: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    worker_id: str | None = None
    server_token_times: list[float] = field(default_factory=list)  # the worker's stamps (diagnostic)
    num_retries: int = 0     # sent again after a refusal (429), each after its Retry-After
    refused: bool = False    # still refused (429) after the retries: the error says so

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.arrival if self.end is not None and self.ok else None

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown request record fields {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class Turn:
    """One stretch of time a worker ran one model (from the engine's timeline)."""

    worker: str
    model: str
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"turn ends before it starts: {self.start} > {self.end}")


def _relative_times(r: RequestRecord) -> list[float]:
    return [t - r.arrival for t in r.token_times]


def meets_goodput(r: RequestRecord, slo: SLO) -> bool:
    """vLLM / DistServe goodput: TTFT within its SLO and mean TPOT within the TBT SLO."""
    if not r.ok or r.ttft > slo.ttft_s:
        return False
    tpot = r.tpot
    return tpot is None or tpot <= slo.tbt_s


def meets_strict(r: RequestRecord, slo: SLO) -> bool:
    if not r.ok:
        return False
    return all(t <= slo.deadline(0.0, k) for k, t in enumerate(_relative_times(r)))


def cumulative_attainment(r: RequestRecord, slo: SLO) -> float:
    """Share of the request's service time inside its deadlines (see module docstring)."""
    if not r.ok:
        return 0.0
    times = _relative_times(r)
    seg_start = credited = last_on_time_due = 0.0
    last_on_time = False
    for k, t in enumerate(times):
        due = slo.deadline(0.0, k)
        last_on_time = t - seg_start <= due
        if last_on_time:
            last_on_time_due = due
        else:
            credited += last_on_time_due
            seg_start, last_on_time_due = t, 0.0
    total = times[-1]
    if total <= 0:
        return 1.0 if last_on_time else 0.0
    if last_on_time:
        credited += total - seg_start
    return min(1.0, credited / total)


# --sweep-metric name -> (per-request score in [0, 1], summary key of its share)
MEASURES = {
    "goodput": (lambda r, slo: float(meets_goodput(r, slo)), "attainment_goodput"),
    "strict": (lambda r, slo: float(meets_strict(r, slo)), "attainment_strict"),
    "cumulative": (cumulative_attainment, "attainment_cumulative"),
}


def attainment_key(metric: str) -> str:
    """The summary key of a measure's attainment ("goodput" -> "attainment_goodput")."""
    if metric not in MEASURES:
        raise ValueError(f"metric must be one of {', '.join(MEASURES)}, got {metric!r}")
    return MEASURES[metric][1]


def percentiles(values: Iterable[float], prefix: str) -> dict[str, float | None]:
    v = np.asarray(list(values), dtype=float)
    return {f"{prefix}_p{p}_s": (float(np.percentile(v, p)) if v.size else None)
            for p in PERCENTILES}


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the first arrival to the last thing that happened (end or last token)."""
    if not records:
        return 0.0
    starts = [r.arrival for r in records]
    ends = [r.end if r.end is not None else (r.token_times[-1] if r.token_times else r.arrival)
            for r in records]
    return max(ends) - min(starts)


def switches_per_second(turns: Iterable[Turn]) -> dict[str, float]:
    """Per worker: model changes between consecutive turns / (last end - first start)."""
    by_worker: dict[str, list[Turn]] = {}
    for t in turns:
        by_worker.setdefault(t.worker, []).append(t)
    rates = {}
    for worker, ts in sorted(by_worker.items()):
        ts.sort(key=lambda t: t.start)
        switches = sum(1 for a, b in zip(ts, ts[1:]) if a.model != b.model)
        span = max(t.end for t in ts) - ts[0].start
        rates[worker] = switches / span if span > 0 else 0.0
    return rates


def _summary(records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    n = len(records)
    num_good = sum(meets_goodput(r, slo) for r in records)
    num_strict = sum(meets_strict(r, slo) for r in records)
    out = {
        "num_requests": n,
        "num_errors": sum(1 for r in records if r.error is not None),
        "num_output_tokens": sum(len(r.token_times) for r in records),
        "attainment_goodput": num_good / n if n else None,
        "attainment_strict": num_strict / n if n else None,
        "attainment_cumulative": (sum(cumulative_attainment(r, slo) for r in records) / n
                                  if n else None),
        "goodput_rps": num_good / duration_s if duration_s > 0 else None,
        "strict_rps": num_strict / duration_s if duration_s > 0 else None,
    }
    out |= percentiles((r.ttft for r in ok), "ttft")
    out |= percentiles((r.tpot for r in ok if r.tpot is not None), "tpot")
    out |= percentiles((g for r in ok for g in r.tbts), "tbt")
    out |= percentiles((r.e2e for r in ok if r.e2e is not None), "e2e")
    return out


def summarize(records: Sequence[RequestRecord], slo: SLO, *, duration_s: float | None = None,
              turns: Iterable[Turn] | None = None) -> dict:
    """Overall and per-model metrics of one run, JSON-ready.

    duration_s: the run's length for goodput (default: first arrival to last end).
    turns: the workers' (worker, model, start, end) timeline, for model switches per second.
    """
    if duration_s is None:
        duration_s = run_duration(records)
    if duration_s < 0 or math.isnan(duration_s):
        raise ValueError(f"duration_s must be >= 0, got {duration_s!r}")
    out = _summary(records, slo, duration_s)
    out["duration_s"] = duration_s
    out["slo"] = {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}
    models = sorted({r.model for r in records})
    out["per_model"] = {m: _summary([r for r in records if r.model == m], slo, duration_s)
                        for m in models}
    if turns is not None:
        rates = switches_per_second(turns)
        out["switches_per_s_per_worker"] = rates
        out["switches_per_s_mean"] = sum(rates.values()) / len(rates) if rates else 0.0
    return out
