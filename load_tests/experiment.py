"""Measuring: contenders driven over traces, rates and seeds, every request kept as a record.

A trace is a way to draw a workload (synthetic arrivals of a chosen burstiness, or a trace
file); seed k draws its k-th sample (a file trace: its k-th window of `max_requests`
requests). A point is one contender at one rate: every seed's sample, time-scaled to
exactly that rate (`sweep.at_rate`), replayed open loop, its records added to the
experiment's RecordSet under (contender, trace, rate, seed). The point's value is the mean
over seeds of the sweep measure's attainment, which is what the rate search
(load_tests/search.py) reads.

With sustained points (RunSettings.sustain, load_tests/sustained.py) a seed's workload is
drawn per rate: the trace's process over the span the point offers, time-scaled from its
nominal rate (1 req/s for synthetic arrivals, the file's mean rate for a trace file).

A Session starts one contender, warms it up (one short request per model), measures any
number of points, then stops it, so a contender never shares the cores with another.
`run_paired` measures contenders seed by seed: every contender sees the same arrival
sequence of a seed, and the order they run in alternates from one seed to the next (so
neither always runs first on a machine that drifts), each started afresh per seed.
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from cluster.planner.metrics import RequestRecord, attainment_key, summarize
from cluster.planner.workloads import Workload
from load_tests import driver
from load_tests.contenders import Contender, Deployment, make_contender, warm_up
from load_tests.records import PointKey, RecordSet
from load_tests.search import SearchPlan, SearchResult, find_max_rate
from load_tests.sweep import RunSettings, at_rate

logger = logging.getLogger(__name__)

DEDICATED_IDLE_SKIP_S = 1.0  # a dedicated device replaying one model's share skips idle past this


@dataclass(frozen=True)
class TraceSpec:
    """How to draw one seed's workload."""

    name: str  # the label in records and reports ("bursty", "poisson", ...)
    arrival: str = "gamma"  # gamma | poisson | onoff (synthetic)
    cv: float = 4.0  # Gamma arrivals' coefficient of variation
    path: str | None = None  # a trace file instead of synthetic arrivals

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a trace needs a name")
        if self.path is None and self.arrival not in ("gamma", "poisson", "onoff"):
            raise ValueError(f"arrival must be gamma, poisson or onoff, got {self.arrival!r}")

    def describe(self) -> dict:
        if self.path:
            return {"name": self.name, "file": self.path}
        out = {"name": self.name, "arrival": self.arrival}
        if self.arrival == "gamma":
            out["cv"] = self.cv
        return out


def trace_spec(args) -> TraceSpec:
    """The trace a load test's arguments name: a file (--trace), else the synthetic arrivals."""
    return TraceSpec(Path(args.trace).stem if args.trace else (
        args.arrival if args.arrival != "gamma" else f"gamma-cv{args.cv:g}"),
        args.arrival, args.cv, path=args.trace)


@dataclass
class Experiment:
    deployment: Deployment
    workload_args: object  # the loadtest arguments that shape synthetic workloads (run_setup.make_workload)
    settings: RunSettings
    seeds: tuple[int, ...] = (0, 1, 2)
    metric: str = "goodput"
    records: RecordSet = field(default_factory=RecordSet)
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig fields of the token contender
    via: str = "engine"  # "http": token and request as the Serve app, over HTTP (contenders.ServeContender)
    http_port: int | None = None  # the loopback port of the Serve app (via "http")
    stop: driver.StopSignal | None = None  # once set (Ctrl-C), nothing more is sent (driver.run's stop)
    _samples: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError("an experiment needs at least one seed")
        attainment_key(self.metric)  # validates the measure's name

    def sample(self, trace: TraceSpec, seed: int) -> Workload:
        """Seed `seed`'s workload of `trace` (max_requests requests, any base rate)."""
        key = (trace, seed)
        if key not in self._samples:
            self._samples[key] = self._draw(trace, seed)
        return self._samples[key]

    def _draw(self, trace: TraceSpec, seed: int) -> Workload:
        from load_tests.run_setup import make_workload

        n = self.settings.max_requests
        names = list(self.deployment.models)
        if trace.path:
            from cluster.planner.traces import read_trace

            whole = read_trace(trace.path, deployed=names, seed=seed)
            if len(whole) < (seed + 1) * n:
                raise ValueError(f"{trace.path} has {len(whole)} requests: too few for seed {seed} "
                                 f"windows of {n}")
            start = whole[seed * n].arrival_s
            return whole.window(start, None, n)
        args = replace_args(self.workload_args, arrival=trace.arrival, cv=trace.cv, seed=seed)
        return make_workload(args, names, 1.0, max(n, 2))

    def session(self, name: str, contender: Contender | None = None) -> "Session":
        """A session of the contender `name` (or of `contender`, one built by the caller)."""
        contender = contender or make_contender(name, self.scheduler, self.via, self.http_port)
        return Session(self, contender, self.stop)

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def point_workload(self, trace: TraceSpec, seed: int, rate: float) -> Workload:
        """What seed `seed` sends at `rate`: a burst of max_requests (sweep.at_rate), or a
        sustained point (see the module docstring)."""
        spec = self.settings.sustain
        if spec is None:
            return at_rate(self.sample(trace, seed), rate, self.settings)
        key = (trace, seed, float(rate))
        if key not in self._samples:
            self._samples[key] = self._draw_sustained(trace, seed, rate)
        return self._samples[key]

    def _draw_sustained(self, trace: TraceSpec, seed: int, rate: float) -> Workload:
        from load_tests.sustained import draw_span

        spec = self.settings.sustain
        names = list(self.deployment.models)
        if trace.path:
            from cluster.planner.traces import read_trace
            from load_tests.sweep import base_rate

            whole = read_trace(trace.path, deployed=names, seed=seed)
            nominal = base_rate(whole)
            span = draw_span(rate, spec, nominal, margin=1.0)
            start = whole[0].arrival_s + seed * span   # seed k: the k-th stretch of the file
            if whole.duration_s < start + span:
                raise ValueError(f"{trace.path} spans {whole.duration_s:.0f} s: too short for seed {seed} "
                                 f"at {rate:g} req/s ({span:.0f} s of the trace per seed); shorten the points "
                                 f"(--sustain-s, --sustain-requests) or replay its first requests once (--burst)")
            return spec.workload(whole.window(start, start + span), rate, nominal)
        args = replace_args(self.workload_args, arrival=trace.arrival, cv=trace.cv, seed=seed)
        from load_tests.run_setup import make_workload

        sample = make_workload(args, names, 1.0, None, duration_s=draw_span(rate, spec))
        return spec.workload(sample, rate, 1.0)

    def run_paired(self, trace: TraceSpec, contenders: Sequence[str], rates: Sequence[float]) -> dict:
        """Every contender at every rate, seed by seed, the order alternating between seeds
        (see the module docstring). Returns what a report says of the contenders: their notes,
        descriptions, warm-up errors and the order each seed ran them in."""
        out: dict = {"notes": [], "descriptions": {}, "warm_up_errors": {}, "order": []}
        for i, seed in enumerate(self.seeds):
            order = list(contenders) if i % 2 == 0 else list(reversed(contenders))
            out["order"].append({"seed": seed, "contenders": order})
            for name in order:
                if self.stopped:
                    return out
                with self.session(name) as session:
                    for rate in rates:
                        session.point(trace, rate, seeds=(seed,))
                    if name not in out["descriptions"]:
                        out["notes"] += [n for n in session.contender.notes(self.deployment)
                                         if n not in out["notes"]]
                        out["descriptions"][name] = session.contender.describe(self.deployment)
                    errors = {m: e for m, e in session.warm_up_errors.items() if e}
                    if errors:
                        out["warm_up_errors"].setdefault(name, {}).update(errors)
        return out


def replace_args(args, **changes):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(args), **changes})


class Session:
    def __init__(self, experiment: Experiment, contender: Contender, stop: driver.StopSignal | None = None):
        self.experiment = experiment
        self.contender = contender
        self.stop = stop
        self.target = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.warm_up_errors: dict[str, str | None] = {}

    @property
    def name(self) -> str:
        return self.contender.name

    def __enter__(self) -> "Session":
        """The contender starts (and warms up) at the first point not already in the
        records, so a run resumed from its records starts nothing it does not measure."""
        self.loop = asyncio.new_event_loop()
        return self

    def _start(self) -> None:
        if self.target is not None:
            return
        self.target = self.contender.start(self.experiment.deployment)
        self.warm_up_errors = self.loop.run_until_complete(
            warm_up(self.target, list(self.experiment.deployment.models)))
        bad = {m: e for m, e in self.warm_up_errors.items() if e}
        if bad:
            logger.warning("%s: warm-up failed for %s", self.name, bad)

    def __exit__(self, *exc) -> None:
        try:
            aclose = getattr(self.target, "aclose", None)   # an HTTP target's connections
            if aclose is not None:
                self.loop.run_until_complete(aclose())
        finally:
            self._stop_contender()

    def _stop_contender(self) -> None:
        try:
            self.contender.stop()
        finally:
            if self.loop is not None:
                self.loop.close()
            self.loop = self.target = None

    def point(self, trace: TraceSpec, rate: float, seeds: Sequence[int] | None = None) -> float:
        """Measure `seeds` (default: the experiment's) at `rate`; returns their mean attainment
        by the sweep measure (a sustained point: over its scored window)."""
        ex = self.experiment
        key = attainment_key(ex.metric)
        values = []
        for seed in (ex.seeds if seeds is None else seeds):
            if ex.stopped:
                break
            point = PointKey(self.name, trace.name, float(rate), seed)
            if point not in ex.records.points:
                # ids unique across points: a server sees each request id once per run
                ex.records.add(point, self._drive(ex.point_workload(trace, seed, rate), seed,
                                                  id_prefix=f"r{rate:g}-s{seed}"))
            records = ex.records.points[point]
            if ex.settings.sustain is not None:
                records = ex.settings.sustain.scored(records, rate)
            summary = summarize(records, ex.deployment.slo)
            values.append(summary[key] or 0.0)
        if not values:
            return 0.0
        mean = statistics.mean(values)
        logger.info("%s on %s at %.4g req/s: %s %.3f (seeds %s)", self.name, trace.name, rate, ex.metric,
                    mean, [round(v, 3) for v in values])
        return mean

    def search(self, trace: TraceSpec, plan: SearchPlan, also: Sequence[float] = ()) -> SearchResult:
        """Measure the rates in `also`, then bracket and bisect (see load_tests/search.py)."""
        known = {float(r): self.point(trace, r) for r in also}
        return find_max_rate(lambda r: self.point(trace, r), plan, known)

    def _drive(self, workload: Workload, seed: int, id_prefix: str = "req") -> list[RequestRecord]:
        self._start()
        settings = self.experiment.settings
        if getattr(self.contender, "sequential_by_model", False):
            return self._drive_by_model(workload, seed)
        records = self.loop.run_until_complete(driver.run(
            self.target, workload, request_timeout_s=settings.request_timeout_s, id_prefix=id_prefix,
            vocab_size=settings.vocab_size, seed=seed, progress=settings.progress,
            idle_skip_s=settings.idle_skip_s, stop=self.stop.event(self.loop) if self.stop else None))
        if settings.settle_s:
            time.sleep(settings.settle_s)
        return records

    def _drive_by_model(self, workload: Workload, seed: int) -> list[RequestRecord]:
        """Each model's requests on a device of its own, one device after another; records
        come back in the workload's order, on the workload's clock (each device's idle
        stretches are skipped: it serves its own model only, so it is mostly idle)."""
        settings = self.experiment.settings
        out: dict[int, RequestRecord] = {}
        for model in workload.models:
            idx = [i for i, r in enumerate(workload) if r.model == model]
            sub = Workload(tuple(workload[i] for i in idx))
            recs = self.loop.run_until_complete(driver.run(
                self.target, sub, request_timeout_s=settings.request_timeout_s,
                vocab_size=settings.vocab_size, seed=seed, progress=False,
                idle_skip_s=settings.idle_skip_s or DEDICATED_IDLE_SKIP_S))
            for i, rec in zip(idx, recs):
                out[i] = replace(rec, request_id=f"req-{i:06d}")
            if settings.settle_s:
                time.sleep(settings.settle_s)
        return [out[i] for i in range(len(workload))]


def count_search(measure: Callable[[int], float], start: int, threshold: float, *, max_count: int,
                 resolution: float = 1.1) -> tuple[int | None, int | None, list[int]]:
    """The model-count analogue of find_max_rate, on integers: double from `start` until the
    threshold is missed (or max_count), then bisect. Returns (largest count that met it,
    smallest above it that missed, counts measured)."""
    seen: dict[int, float] = {}
    order: list[int] = []

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = measure(n)
            order.append(n)
        return seen[n] >= threshold

    if not ok(start):
        return None, start, order
    lo, hi = start, None
    while hi is None:
        up = min(lo * 2, max_count)
        if up == lo:
            return lo, None, order
        if ok(up):
            lo = up
        else:
            hi = up
    while hi - lo > 1 and hi / lo > resolution:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, order


def measure_model_count(n: int, checkpoint: str, args, threads: int, slo, settings, seeds, metric: str,
                        trace: TraceSpec, rate_per_model: float) -> tuple[dict, RecordSet]:
    """The token contender on one worker serving n copies of `checkpoint`, at n x rate_per_model
    req/s: the point's summary (analysis.point_summary) and its records."""
    from load_tests.analysis import point_summary
    from load_tests.run_setup import engine_config, served_models

    models = served_models(str(n), checkpoint)
    deployment = Deployment(models, 1, engine_config(models, args), threads, slo)
    ex = Experiment(deployment, args, settings, seeds=tuple(seeds), metric=metric)
    rate = float(f"{rate_per_model * n:.4g}")
    with ex.session("token") as s:
        s.point(trace, rate)
    summary = point_summary(ex.records.select("token", trace.name)[rate], slo)
    summary["num_models"], summary["rate"] = n, rate
    return summary, ex.records


def write_json(path: str | Path, data: dict) -> Path:
    """`data` as JSON at `path`, with the provenance block (load_tests/provenance.py) added
    when it has none."""
    import json

    from load_tests.provenance import provenance

    if "provenance" not in data:
        data = {**data, "provenance": provenance()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str, allow_nan=False) + "\n")
    return path
