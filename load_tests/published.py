"""The published side-by-side run: one command, every figure of the load-test section of
docs/benchmarks.md (and the load-test rows of the README's table).

    tokenmux loadtest --published [--out docs/results] [--short | --quick | --gpu]

(--short: the reduced preset of Preset.short, ~35 min; --quick: tests; --gpu: one CUDA device.)

What it runs, on this machine, each contender alone on the cores (load_tests/experiment.py):

  deployment  12 copies of a tiny zoo checkpoint (llama-tiny-a, ~1M parameters) on ONE
              device (DeviceWorker / Serve replica) holding 2 of them at a time, 1 torch
              thread; SLO measured from that model's own step times (load_tests/slo.py)
  traces      "bursty" (the loadtest default: Gamma arrivals CV 4, Zipf(1) popularity,
              Azure conversation lengths) and "poisson" (the same with Poisson arrivals)
  points      3 seeds x 120 requests each; mean and 95% CI per rate and measure; when
              nothing is in flight for 1 s the driver skips to the next arrival (a bursty
              trace's silences cost no wall time; the system is empty, nothing changes)
  token       bracket by doubling from the start rate (halving to start/4 if it misses
              there), bisect to <= 10%, then the doubling grid one step past its failure (the
              rates every other contender shares)
  request     that grid plus its own search and bisection (so "never below" compares like
              rates)
  multiplexed Ray Serve @serve.multiplexed at max_ongoing_requests 1, 2, 8: searched up from
              the start rate; one that misses there is measured once more at start/4, and
              bisected to 10% if it meets 90% there, else it "never reaches 90% even at" start/4
  ablations   token without the quota cap, without overload control: at token's bracket and
              the grid above half of it, where overload starts (bursty trace)
  dedicated   12 devices (one per model), at the highest rate token met the threshold
  SLO table   every record re-scored under TTFT:TPOT = 16 and 100 and the SLO x0.5, x1, x2
  models      max models one worker serves at 90% goodput with 0.1 req/s each (Aegaeon's
              setting: every model a Poisson stream of 0.1 req/s)

Rates are not fixed numbers: the start rate of each trace is a fraction of the model's
service rate mu = 1 / (prefill + mean output tokens x decode step), from the same measured
step times as the SLO, so a faster engine moves rates, SLOs and run time together and the
design stays self-consistent.

It writes docs/results/loadtest-{bursty,poisson,models}.json, the records of every request
(loadtest-records.jsonl.gz, enough to re-score: `tokenmux loadtest --rescore FILE`),
attainment-vs-rate and latency-CDF plots, loadtest-report.md, and refreshes the published
section of docs/benchmarks.md between its markers (`readme=`, BENCHMARKS_DOC by default).

`--resume` continues a run from its records (a crash, or a contender or search step added
since): the SLO is the one the records were scored under (never measured again), a point
already recorded is never measured again, and a contender with nothing left to measure is
not even started. The preset's fields that shape a point must match the records' (else an
error names them); the run time adds up over the invocations.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from load_tests.search import SearchPlan, doubling_grid

logger = logging.getLogger(__name__)

MUXES = ("multiplexed-1", "multiplexed-2", "multiplexed-8")
RECORDS = "loadtest-records.jsonl.gz"
RUN_TIME = ("elapsed_s", "phase_s")   # the meta a resumed run adds up (kept in the records' header)
# the preset fields a measured point depends on: a resumed run must keep them
POINT_SHAPING = ("models", "checkpoint", "slots", "threads", "seeds", "max_requests", "start_fraction",
                 "request_timeout_factor", "settle_s", "idle_skip_s", "max_input", "max_output", "kv_mb",
                 "device", "dtype")
ABLATIONS = ("token-no-cap", "token-no-overload")


@dataclass(frozen=True)
class Preset:
    models: int = 12
    checkpoint: str = "llama-tiny-a"
    slots: int = 2
    threads: int = 1
    seeds: tuple[int, ...] = (0, 1, 2)
    max_requests: int = 120
    threshold: float = 0.9
    metric: str = "goodput"
    resolution: float = 1.1
    max_rate_factor: float | None = None  # search no higher than start x this (None: until it misses)
    # start rate of each trace as a fraction of the service rate mu (see the module docstring):
    # low enough that request-level still meets the threshold there on this machine
    start_fraction: dict = field(default_factory=lambda: {"bursty": 0.015, "poisson": 0.1})
    probe_down: float = 4.0  # token and request halve down to start / this when the start misses;
    # the Serve peer steps there at once
    contenders: tuple[str, ...] = ("token", "request", *MUXES, *ABLATIONS, "dedicated")
    ablation_traces: tuple[str, ...] = ("bursty",)
    model_rate: float = 0.1  # req/s per model in the models sweep
    model_start: int = 16  # the models sweep doubles from here
    max_models: int = 128
    request_timeout_factor: float = 4.0  # timeout = this x (TTFT SLO + max_output x TBT SLO), >= 2 s
    settle_s: float = 0.5
    idle_skip_s: float | None = 0.5  # skip the driver's clock over idle stretches past this (driver.run)
    max_input: int = 256  # Azure conversation lengths x 0.125 (input) and x 0.25 (output), clipped here
    max_output: int = 256
    kv_mb: float = 64.0
    device: str = "cpu"
    dtype: str | None = None
    traces: tuple[str, ...] = ("bursty", "poisson")
    models_sweep: bool = True
    # measure every contender at these x mu instead of searching: one tuple for every trace,
    # or a dict trace -> tuple
    fixed_fractions: tuple[float, ...] | dict | None = None
    # with a fixed grid: token keeps doubling past its top until its mean misses the threshold,
    # no higher than this x mu (one float, or a dict trace -> float), so its max rate is a
    # crossing, not a bound; request and the ablations follow token's grid, the Serve peer and
    # dedicated stay on the fixed one (None: the fixed grid only)
    extend_until_miss: float | dict | None = None

    @classmethod
    def gpu(cls, quick: bool = False) -> "Preset":
        """The same side-by-side on one GPU with real-size models: 8 copies of a 7B shape
        (random bf16 weights, load_tests/bench/shapes.py), 3 of them resident at a time in
        the budget, the rest swapped in from the host cache over PCIe (the peer loads with
        from_pretrained). Device time is short, so: the Poisson trace, a fixed grid of rates
        (fractions of mu) instead of a search, 1 seed x 40 requests (quick: token and request,
        2 rates x 24 requests). Sized for ~6 minutes (quick ~3) on an H200; not run yet."""
        if quick:
            return cls(models=8, checkpoint="shape:qwen2.5-7b", slots=3, threads=4, seeds=(0,), max_requests=24,
                       contenders=("token", "request"), kv_mb=16384.0, device="cuda", dtype="bfloat16",
                       traces=("poisson",), models_sweep=False, settle_s=0.5, fixed_fractions=(0.5, 1.0))
        return cls(models=8, checkpoint="shape:qwen2.5-7b", slots=3, threads=4, seeds=(0,), max_requests=40,
                   contenders=("token", "request", "multiplexed-8"), kv_mb=16384.0, device="cuda",
                   dtype="bfloat16", traces=("poisson",), models_sweep=False, settle_s=0.5,
                   fixed_fractions=(0.25, 0.5, 1.0))

    @classmethod
    def short(cls) -> "Preset":
        """The published run cut to ~35 minutes of a shared 2-core machine: the same 12 models,
        SLO, traces and 3 seeds, but 60 requests per point (not 120), a fixed grid of 4 rates
        per trace (fractions of mu, doubling: the max rate at 90% is interpolated between
        grid points, not bisected to 10%) that token and request extend by doubling until
        token misses (bursty up to 1.92 x mu, Poisson up to 6.4 x mu; the Serve peer, far past
        its crossing at the grid's top, stays on the 4 rates), token, request and one Serve
        configuration (max_ongoing_requests 8), no ablations, no dedicated fleet, no models sweep."""
        return cls(max_requests=60, contenders=("token", "request", "multiplexed-8"), models_sweep=False,
                   fixed_fractions={"bursty": (0.015, 0.03, 0.06, 0.12), "poisson": (0.1, 0.2, 0.4, 0.8)},
                   extend_until_miss={"bursty": 1.92, "poisson": 6.4})

    @classmethod
    def quick(cls) -> "Preset":
        """The same code paths in about a minute (tests): 3 models, 1 seed x 6 requests, a fixed
        grid of two rates (below and past mu) instead of a search. One seed: what several add
        (alternating order, intervals over seeds) is the runner's, tested on `loadtest --seeds`."""
        return cls(models=3, seeds=(0,), max_requests=6, model_start=2, max_models=4,
                   fixed_fractions=(0.5, 2.0),
                   contenders=("token", "request", "multiplexed-1", "token-no-overload", "dedicated"),
                   settle_s=0.2)


BENCHMARKS_DOC = "docs/benchmarks.md"   # holds the published section (load_tests/report.py's markers)


def run_published(out_dir: str | Path = "docs/results", *, quick: bool = False, gpu: bool = False,
                  short: bool = False, readme: str | Path | None = BENCHMARKS_DOC, preset: Preset | None = None,
                  sweep_models: bool = True, resume: bool = False) -> dict:
    """Run everything and write the results; returns the summary. sweep_models=False leaves the
    models sweep out of any preset; resume=True continues from out_dir's records (module
    docstring)."""
    from cluster.ray_runtime import connect_or_start
    from load_tests.contenders import Deployment
    from load_tests.experiment import Experiment, TraceSpec
    from load_tests.records import write_records
    from load_tests.run_setup import engine_config, measured_slo, served_models
    from load_tests.sweep import RunSettings
    from scheduler.slo import SLO

    p = preset or (Preset.gpu(quick) if gpu else Preset.quick() if quick else Preset.short() if short else Preset())
    if not sweep_models:
        p = replace(p, models_sweep=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    args = workload_args(p)
    previous = resumable(out / RECORDS, p, vars(args)) if resume else None
    connect_or_start(num_virtual_gpus=1, log_to_driver=False)
    models = served_models(str(p.models), p.checkpoint)
    slo_info = previous.run["slo"] if previous else measured_slo(models, args, p.threads)
    slo = SLO(slo_info["ttft_s"], slo_info["tbt_s"])
    logger.info("SLO: TTFT %.4g s, TBT %.4g s, from %s", slo.ttft_s, slo.tbt_s, slo_info["derived_from"])
    timeout = max(2.0, p.request_timeout_factor * (slo.ttft_s + args.max_output * slo.tbt_s))
    settings = RunSettings(max_requests=p.max_requests, request_timeout_s=timeout, settle_s=p.settle_s,
                           idle_skip_s=p.idle_skip_s)
    deployment = Deployment(models, 1, engine_config(models, args), p.threads, slo)
    ex = Experiment(deployment, args, settings, seeds=p.seeds, metric=p.metric)
    if previous:
        ex.records.points = previous.points
        logger.info("resuming from %s: %d points recorded", out / RECORDS, len(previous.points))
    traces = [t for t in (TraceSpec("bursty", "gamma", 4.0), TraceSpec("poisson", "poisson")) if t.name in p.traces]
    ex.records.run = {"preset": _asdict(p), "slo": slo_info, "request_timeout_s": timeout,
                      "deployment": {"models": models, "num_workers": 1, "threads_per_worker": p.threads,
                                     "engine": deployment.engine},
                      "traces": [t.describe() for t in traces], "workload": vars(args)}
    mu = service_rate(slo_info["derived_from"], ex, traces)
    starts = {t.name: _round(p.start_fraction[t.name] * mu) for t in traces}
    timings: dict[str, float] = {}
    plans: dict[str, dict] = {t.name: {} for t in traces}
    descriptions: dict[str, str] = {}

    def phase(name: str, fn):
        t0 = time.time()
        result = fn()
        timings[name] = round(time.time() - t0, 1)
        logger.info("phase %s done in %.0f s", name, timings[name])
        return result

    def plan(rate: float) -> SearchPlan:
        top = rate * p.max_rate_factor if p.max_rate_factor else None
        return SearchPlan(start=rate, threshold=p.threshold, resolution=p.resolution, max_rate=top,
                          min_rate=rate / p.probe_down)

    # token first: its search sets the grid every other contender shares
    grids: dict[str, list[float]] = {}
    fixed_grids: dict[str, list[float]] = {}
    with ex.session("token") as s:
        descriptions["token"] = s.contender.describe(deployment)
        for t in traces:
            if p.fixed_fractions:   # a fixed grid (short and GPU presets: time is short)
                fractions = _per_trace(p.fixed_fractions, t.name)
                fixed_grids[t.name] = [_round(f * mu) for f in fractions]
                grids[t.name] = phase(f"token/{t.name}", lambda: grid_until_miss(
                    lambda r: s.point(t, r), fractions, mu, p.threshold, _per_trace(p.extend_until_miss, t.name)))
                continue
            res = phase(f"token/{t.name}", lambda: s.search(t, plan(starts[t.name])))
            # the search may have probed below the start rate (it missed there): the grid then starts lower
            lowest = min(starts[t.name], res.lo or res.hi or starts[t.name])
            top = max((res.hi or res.lo or starts[t.name]) * 2, lowest)
            grids[t.name] = doubling_grid(lowest, top)
            phase(f"token/{t.name}/grid", lambda: [s.point(t, r) for r in grids[t.name]])
            plans[t.name]["token"] = {"lo": res.lo, "hi": res.hi}
    for name in [c for c in p.contenders if c != "token"]:
        todo = [t for t in traces if name not in ABLATIONS or t.name in p.ablation_traces]
        with ex.session(name) as s:
            descriptions[name] = s.contender.describe(deployment)
            for t in todo:
                token = plans[t.name].get("token", {})
                if p.fixed_fractions:   # request and the ablations on token's grid (to compare like rates)
                    rates = grids[t.name] if name == "request" or name in ABLATIONS else fixed_grids[t.name]
                    phase(f"{name}/{t.name}", lambda: [s.point(t, r) for r in rates])
                elif name == "dedicated":   # the fleet at the highest rate token met the threshold
                    phase(f"{name}/{t.name}", lambda: s.point(t, token.get("lo") or starts[t.name]))
                elif name in ABLATIONS:   # where overload starts: the top of the grid, token's bracket
                    lo = token.get("lo") or starts[t.name]
                    rates = sorted({r for r in grids[t.name] if r >= lo / 2} | {lo, token.get("hi") or lo})
                    phase(f"{name}/{t.name}", lambda: [s.point(t, r) for r in rates])
                elif name == "request":   # the shared grid, then its own search
                    res = phase(f"{name}/{t.name}", lambda: s.search(t, plan(starts[t.name]), also=grids[t.name]))
                    plans[t.name][name] = {"lo": res.lo, "hi": res.hi}
                else:   # the Serve peer: up from the start, or one step down to start / probe_down
                    peer = replace(plan(starts[t.name]), down_factor=p.probe_down)
                    res = phase(f"{name}/{t.name}", lambda: s.search(t, peer))
                    plans[t.name][name] = {"lo": res.lo, "hi": res.hi}
        write_records(out / RECORDS, ex.records)   # progress survives a crash (--resume)
    models_result = phase("models", lambda: models_sweep(p, args, settings, slo, out)) if p.models_sweep else None
    elapsed = time.time() - t_start
    if previous:   # the run time and phases add up over the invocations
        before = previous.run["meta"]
        elapsed += before.get("elapsed_s", 0.0)
        for key, value in before.get("phase_s", {}).items():
            timings[key] = round(timings.get(key, 0.0) + value, 1)
        ex.records.run["resumed"] = previous.run.get("resumed", 0) + 1
    meta = {"elapsed_s": round(elapsed, 1), "phase_s": timings, "service_rate_rps": mu, "start_rates": starts,
            "grids": grids, "fixed_grids": fixed_grids, "searches": plans, "descriptions": descriptions,
            "devices": {c: deployment.devices(c) for c in p.contenders}}
    ex.records.run["meta"] = {k: meta[k] for k in RUN_TIME}
    write_records(out / RECORDS, ex.records)
    return write_outputs(ex.records, slo, out, meta=meta, models=models_result, readme=readme)


def workload_args(p: Preset):
    """The workload and engine arguments of a preset's runs (run_setup reads them): Zipf(1)
    popularity, Azure conversation lengths x 0.125 / x 0.25, the preset's limits and device."""
    from types import SimpleNamespace

    return SimpleNamespace(arrival="gamma", cv=4.0, popularity="zipf", zipf_alpha=1.0, lengths="azure",
                           input_scale=0.125, output_scale=0.25, max_input=p.max_input, max_output=p.max_output,
                           seed=0, kv_mb=p.kv_mb, slots=p.slots, budget=None, slo_ttft=None, slo_tbt=None,
                           device=p.device, dtype=p.dtype)


def resumable(path: Path, p: Preset, workload: dict):
    """The records of a run to resume with preset `p`: every field that shapes a measured
    point must match (a ValueError names those that do not)."""
    import json

    from load_tests.records import read_records

    previous = read_records(path)
    if "slo" not in previous.run or "preset" not in previous.run:
        raise ValueError(f"{path}: no run header (SLO and preset): not a published run's records")
    def as_stored(value: dict) -> dict:   # as the header's JSON holds it (tuples are lists there)
        return json.loads(json.dumps(value, default=str))

    stored, now = previous.run["preset"], as_stored(_asdict(p))
    differ = [k for k in POINT_SHAPING if stored.get(k) != now[k]]
    stored_workload = previous.run.get("workload", {})
    differ += [f"workload.{k}" for k, v in as_stored(workload).items() if stored_workload.get(k) != v]
    if differ:
        raise ValueError(f"cannot resume from {path}: the preset differs from the records' in {differ}")
    if "meta" not in previous.run:   # records written before the run header kept its run time
        summary = path.parent / "loadtest-summary.json"
        meta = json.loads(summary.read_text()).get("meta", {}) if summary.is_file() else {}
        previous.run["meta"] = {k: meta[k] for k in RUN_TIME if k in meta}
    return previous


def grid_until_miss(point, fractions, mu: float, threshold: float, max_fraction: float | None) -> list[float]:
    """Measure `point` (rate -> mean attainment) at each fraction x mu, then keep doubling
    while no rate has missed the threshold, up to max_fraction x mu (None: no doubling).
    Returns the rates measured, ascending."""
    rates = [_round(f * mu) for f in fractions]
    missed = min(point(r) for r in rates) < threshold
    top = fractions[-1]
    while not missed and max_fraction is not None and top * 2 <= max_fraction * (1 + 1e-9):
        top *= 2
        rates.append(_round(top * mu))
        missed = point(rates[-1]) < threshold
    return rates


def service_rate(times: dict, ex, traces) -> float:
    """mu = 1 / (prefill of the SLO's prompt + mean output tokens x decode step), req/s."""
    outputs = [r.output_len for t in traces for s in ex.seeds for r in ex.sample(t, s)]
    return 1.0 / (times["prefill_s"] + statistics.mean(outputs) * times["decode_s"])


def models_sweep(p: Preset, args, settings, slo, out: Path) -> dict:
    """Largest model count one worker serves at the threshold with 0.1 req/s per model:
    Aegaeon's setting (each model a Poisson stream of 0.1 req/s: Poisson arrivals, uniform
    popularity). Its records go to loadtest-models-records.jsonl.gz (trace "models-N")."""
    from load_tests.experiment import TraceSpec, count_search, measure_model_count, replace_args
    from load_tests.records import PointKey, RecordSet, write_records

    trace = TraceSpec("models", "poisson")
    args = replace_args(args, popularity="uniform")
    per_count: dict[int, dict] = {}
    kept = RecordSet(run={"slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "rate_per_model": p.model_rate})

    def measure(n: int) -> float:
        summary, records = measure_model_count(n, p.checkpoint, args, p.threads, slo, settings, p.seeds,
                                               p.metric, trace, p.model_rate)
        for key, recs in records.points.items():
            kept.add(PointKey(key.contender, f"{trace.name}-{n}", key.rate, key.seed), recs)
        write_records(out / "loadtest-models-records.jsonl.gz", kept)
        per_count[n] = {"rate": summary["rate"], **{m: summary[m] for m in ("goodput", "strict", "cumulative")}}
        return summary[p.metric]["mean"]

    best, above, order = count_search(measure, p.model_start, p.threshold, max_count=p.max_models,
                                      resolution=p.resolution)
    kind = "measured" if best is not None and above is not None else (
        "lower bound: the largest count tested met the threshold" if best is not None else
        f"below {p.model_start}: the smallest count tested missed the threshold")
    return {"max_models_per_worker_at_90": best, "max_models_per_worker_at_90_kind": kind,
            "first_count_missing": above, "rate_per_model": p.model_rate, "measure": p.metric,
            "counts_measured": order, "trace": trace.describe(),
            "points": {str(n): per_count[n] for n in sorted(per_count)},
            "note": f"counts below {p.model_start} are not measured (each costs more time than the last: "
                    f"{p.max_requests} requests at {p.model_rate} req/s per model)"}


def write_outputs(records, slo, out: Path, *, meta: dict, models: dict | None, readme) -> dict:
    """Analyse the records and write every published file; returns the summary."""
    from load_tests.analysis import analyze_trace, slo_sensitivity
    from load_tests.experiment import write_json
    from load_tests.report import plot_cdfs, plot_attainment_bands, published_markdown, update_readme

    summary = {"measure": "goodput", "meta": meta, "traces": {}}
    for trace in records.traces():
        result = analyze_trace(records, trace, slo, metric="goodput", devices=meta.get("devices"))
        result["slo_sensitivity"] = slo_sensitivity(records, trace, slo)
        result["run"] = records.run
        result["meta"] = meta
        for name, data in result["contenders"].items():
            data["description"] = meta.get("descriptions", {}).get(name, name)
        write_json(out / f"loadtest-{trace}.json", result)
        plot_attainment_bands(result, out / f"loadtest-{trace}-attainment.png")
        plot_cdfs(records, trace, result, out / f"loadtest-{trace}")
        summary["traces"][trace] = {k: v for k, v in result.items()
                                    if k.startswith("token_vs_") or k.startswith("token_never") or k == "best_multiplexed"}
    if models is not None:
        write_json(out / "loadtest-models.json", models)
        summary["max_models_per_worker_at_90"] = models["max_models_per_worker_at_90"]
        summary["max_models_per_worker_at_90_kind"] = models["max_models_per_worker_at_90_kind"]
    markdown = published_markdown(out, summary)
    (out / "loadtest-report.md").write_text(markdown)
    if readme:
        update_readme(readme, markdown)
    write_json(out / "loadtest-summary.json", summary)
    return summary


def _per_trace(value, trace: str):
    """A preset setting given once for every trace, or as a dict trace -> value."""
    return value.get(trace) if isinstance(value, dict) else value


def _asdict(p: Preset) -> dict:
    from dataclasses import asdict

    return asdict(p)


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")
