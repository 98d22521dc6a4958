"""Sweeps: one contender over several arrival rates, or over several model counts.

Rate sweep. The same requests are replayed time-scaled: the first `max_requests` of the
base workload (arrival times, models, lengths) are sent at every rate, compressed by
rate / base_rate, so rates differ only in how close together the requests come. A
contender is started and warmed up once, then measured at each rate in increasing order
(with a pause between points so that nothing of one point leaks into the next), then
stopped. Its `max_rate_at_90` is `report.max_rate_at` of {rate: attainment}.

Model-count sweep. The token contender on one worker serves n models, n growing, each
with the same per-model arrival rate (total rate = n x per-model rate), until attainment
falls below the threshold. The answer is the largest n tested that still met it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from load_tests import driver
from load_tests.contenders import Contender, Deployment, warm_up
from load_tests.metrics import RequestRecord, Turn, summarize
from load_tests.workloads import Workload

logger = logging.getLogger(__name__)

ATTAINMENT_KEYS = {"strict": "attainment_strict", "cumulative": "attainment_cumulative"}


@dataclass
class PointResult:
    """One measured run: a contender at one rate (or one model count)."""

    rate: float
    summary: dict
    records: list[RequestRecord] = field(repr=False)
    turns: list[Turn] = field(repr=False)


@dataclass(frozen=True)
class RunSettings:
    """How each point is driven; the same for every contender."""

    max_requests: int = 60
    duration_s: float | None = None  # cut each point's arrivals at this many seconds
    request_timeout_s: float = 60.0
    settle_s: float = 1.0  # pause between points
    vocab_size: int = 2048  # prompts are token ids below this
    seed: int = 0
    progress: bool = False

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s!r}")


def base_rate(workload: Workload) -> float:
    """Arrivals per second of a workload: (n - 1) gaps over its span."""
    if len(workload) < 2 or workload.duration_s <= 0:
        raise ValueError("a workload needs at least two requests at distinct times to have a rate")
    return (len(workload) - 1) / (workload.duration_s - workload[0].arrival_s)


def at_rate(workload: Workload, rate: float, settings: RunSettings) -> Workload:
    """The first max_requests requests of `workload`, time-scaled to `rate` arrivals/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    head = workload.window(0.0, None, settings.max_requests)
    scaled = head.time_scaled(rate / base_rate(head))
    return scaled.window(0.0, settings.duration_s) if settings.duration_s else scaled


async def measure(contender: Contender, target, workload: Workload, deployment: Deployment,
                  settings: RunSettings, rate: float) -> PointResult:
    """Drive one workload open loop and summarise it against the deployment's SLO."""
    since = time.time()
    records = await driver.run(target, workload, request_timeout_s=settings.request_timeout_s,
                               vocab_size=settings.vocab_size, seed=settings.seed,
                               progress=settings.progress)
    turns = contender.turns(since, records)
    summary = summarize(records, deployment.slo, turns=turns)
    summary["rate"] = rate
    logger.info("%s at %.3g req/s: strict %.3f cumulative %.3f (%d requests, %d errors)",
                contender.name, rate, summary["attainment_strict"] or 0.0,
                summary["attainment_cumulative"] or 0.0, summary["num_requests"], summary["num_errors"])
    if settings.settle_s:
        await asyncio.sleep(settings.settle_s)
    return PointResult(rate, summary, records, turns)


def rate_sweep(contender: Contender, deployment: Deployment, workload: Workload,
               rates: Sequence[float], settings: RunSettings) -> tuple[dict[float, PointResult], dict]:
    """Start the contender, warm it up, measure each rate (increasing), stop it.
    Returns ({rate: PointResult}, {model: warm-up error or None})."""
    rates = sorted({float(r) for r in rates})
    if not rates or rates[0] <= 0:
        raise ValueError(f"rates must be positive and non-empty, got {list(rates)}")

    async def sweep(target) -> tuple[dict[float, PointResult], dict]:
        warm = await warm_up(target, list(deployment.models))
        points = {}
        for rate in rates:
            points[rate] = await measure(contender, target, at_rate(workload, rate, settings),
                                         deployment, settings, rate)
        return points, warm

    target = contender.start(deployment)
    try:
        return asyncio.run(sweep(target))
    finally:
        contender.stop()


def attainment_by_rate(points: dict[float, PointResult], metric: str = "strict") -> dict[float, float]:
    key = ATTAINMENT_KEYS.get(metric)
    if key is None:
        raise ValueError(f"metric must be one of {sorted(ATTAINMENT_KEYS)}, got {metric!r}")
    return {rate: p.summary[key] or 0.0 for rate, p in points.items()}


def model_count_sweep(contender_factory: Callable[[], Contender],
                      deployment_for: Callable[[int], Deployment],
                      workload_for: Callable[[Deployment], Workload],
                      counts: Sequence[int], settings: RunSettings, *, threshold: float = 0.9,
                      metric: str = "strict") -> tuple[int | None, dict[int, dict]]:
    """For n in counts (increasing): a fresh contender on deployment_for(n), driven by
    workload_for(deployment), until attainment < threshold. Returns (largest n that met
    the threshold before the first miss, or None; {n: summary})."""
    counts = sorted({int(n) for n in counts})
    if not counts or counts[0] < 1:
        raise ValueError(f"model counts must be positive and non-empty, got {list(counts)}")
    key = ATTAINMENT_KEYS.get(metric)
    if key is None:
        raise ValueError(f"metric must be one of {sorted(ATTAINMENT_KEYS)}, got {metric!r}")
    best, summaries = None, {}
    for n in counts:
        deployment = deployment_for(n)
        workload = workload_for(deployment)
        contender = contender_factory()
        target = contender.start(deployment)
        try:
            async def point():
                await warm_up(target, list(deployment.models))
                return await measure(contender, target, workload, deployment, settings,
                                     base_rate(workload))
            result = asyncio.run(point())
        finally:
            contender.stop()
        result.summary["num_models"] = n
        summaries[n] = result.summary
        attained = result.summary[key] or 0.0
        logger.info("model-count sweep: %d models -> %s %.3f", n, key, attained)
        if attained < threshold:
            break
        best = n
    return best, summaries
