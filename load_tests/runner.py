"""`tokenmux loadtest`: arguments -> workload -> contenders one after another -> report.

    tokenmux loadtest --trace FILE.csv --contenders token,request,dedicated,multiplexed \
        --workers W --sweep rate --json OUT.json --plots DIR
    tokenmux loadtest --published            # the published side-by-side run (load_tests/published.py)
    tokenmux loadtest --rescore RECORDS.jsonl.gz --slo-ttft 0.2 --json OUT.json   # re-score, no re-run
    tokenmux loadtest --sweep slo [--slo-shapes ...]   # re-run at each SLO shape (load_tests/slo_sweep.py)

Without --trace the workload is synthetic: Gamma arrivals (CV 4, bursty), Zipf(1) model
popularity (a long tail that still has several active models when only ~10 are served;
--popularity longtail gives Aegaeon's 94.1% / 1.35% calibration, which with 8 models sends
98.7% of requests to one model) and lengths resampled from the Azure LLM 2023
conversation trace, scaled and clipped to the tiny models' budget. Served models are n
copies of one zoo checkpoint under distinct names (each is a separate model to every
contender: its own weight slot, its own LRU entry), or a list of zoo names.

Every point is run once per seed (--seeds) and judged by three measures; --sweep-metric
(goodput by default) is the one the rate search and the headline ratios use. Every request
is kept as a record beside the JSON (--records, default OUT.records.jsonl.gz).

This module imports only the standard library at the top, so `tokenmux --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from load_tests.run_setup import (AZURE_CONV, DATA_DIR, engine_config, make_workload, measured_slo,  # re-exported
                                  run_settings, scheduler_overrides, served_models)

logger = logging.getLogger(__name__)

RATE_STEPS = (0.25, 0.5, 1.0, 2.0, 4.0)  # default sweep: these multiples of --rate


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace CSV (Aegaeon, Azure 2023 or BurstGPT); default: synthetic")
    p.add_argument("--contenders", type=_csv(str), default=["token", "request"],
                   help="comma list of token,request,dedicated,multiplexed[-1|-2|-8],token-no-cap,"
                        "token-no-overload (default token,request)")
    p.add_argument("--workers", type=int, default=2, help="devices (DeviceWorkers / replicas) per contender")
    p.add_argument("--sweep", type=_csv(str), default=[],
                   help="comma list of rate,models (default: none); or slo alone: every contender re-run at "
                        "each SLO shape on the published traces (load_tests/slo_sweep.py); or devices alone: "
                        "the fewest devices each contender needs at --rate (load_tests/device_sweep.py)")
    p.add_argument("--slo-shapes", type=_csv(str),
                   default=["measured", "ttft:tpot=16", "ttft:tpot=100", "x0.5", "x2"],
                   help="--sweep slo: the SLO shapes to run (default all: measured, ttft:tpot=16, "
                        "ttft:tpot=100, x0.5, x2)")
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--plots", help="directory for report.md and PNG plots")
    p.add_argument("--models", default="8",
                   help="number of served models (copies of --checkpoint) or a comma list of zoo names")
    p.add_argument("--checkpoint", default="llama-10m", help="zoo name or checkpoint dir for --models N")
    p.add_argument("--slots", type=int, default=2, help="weight slots per worker (the peer's LRU size)")
    p.add_argument("--budget", type=float, help="device budget per worker in MiB (default: KV + slots)")
    p.add_argument("--kv-mb", type=float, default=64.0, help="KV pool per worker in MiB")
    p.add_argument("--rate", type=float, help="reference arrival rate, req/s (default: 1, or the trace's)")
    p.add_argument("--rates", type=_csv(float), help="rates of the rate sweep (default: multiples of --rate)")
    p.add_argument("--sustain-s", type=float, default=60.0, help="each point offers its rate for a scored "
                   "window of at least this many seconds (load_tests/sustained.py)")
    p.add_argument("--sustain-requests", type=int, default=300, help="... and long enough to expect at least "
                   "this many requests in it")
    p.add_argument("--warmup-s", type=float, default=10.0, help="offered before each scored window, left out of "
                   "the score")
    p.add_argument("--burst", action="store_true", help="points are bursts of --max-requests requests (the "
                   "older form), not sustained")
    p.add_argument("--max-requests", type=int, default=60, help="--burst: requests per measured point")
    p.add_argument("--duration", type=float, help="cut each point's arrivals after this many seconds")
    p.add_argument("--url", help="drive the OpenAI-compatible server at URL instead of starting contenders "
                   "(load_tests/url_load.py); needs --slo-ttft and --slo-tbt")
    p.add_argument("--served-models", type=_csv(str), help="--url: the server's model names to send "
                   "(default: its GET /v1/models), most popular first")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="--url: bearer key "
                   "(default $OPENAI_API_KEY)")
    p.add_argument("--no-ignore-eos", action="store_true", help="--url: do not send ignore_eos (for servers "
                   "that refuse it; outputs may then end before the trace's length)")
    p.add_argument("--prompt", choices=("ids", "text"), default="ids", help="--url: prompts as token ids "
                   "(exact lengths) or text of common words (about one token each)")
    p.add_argument("--max-duration", type=float, help="--url: stop the whole run after this many seconds "
                   "(what was measured is kept)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--idle-skip", type=float, metavar="S",
                   help="when nothing is in flight for S seconds, skip the clock to the next arrival")
    p.add_argument("--settle", type=float, metavar="S",
                   help="pause between measured points, so one does not leak into the next (default 1 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in s (default: measured, see load_tests/slo.py)")
    p.add_argument("--slo-tbt", type=float, help="TBT SLO in s (default: measured)")
    p.add_argument("--threshold", type=float, default=0.9, help="attainment the sweeps look for")
    p.add_argument("--sweep-metric", choices=("goodput", "strict", "cumulative"), default="goodput",
                   help="measure the rate search and the headline ratios use (default goodput: TTFT and "
                        "mean TPOT within the SLO, as vLLM's benchmark and DistServe count it)")
    p.add_argument("--seeds", type=_csv(int), default=[0, 1, 2, 3, 4],
                   help="workload samples per point (mean and 95%% CI over them; default 0,1,2,3,4); every "
                        "contender sees the same arrivals per seed, their order alternating between seeds")
    p.add_argument("--search", action="store_true",
                   help="rate sweep: bracket from --rate by doubling/halving and bisect to --resolution "
                        "instead of the fixed --rates")
    p.add_argument("--resolution", type=float, default=1.1, help="--search stops when hi / lo <= this")
    p.add_argument("--records", help="per-request records (JSONL; .gz compresses); default beside --json")
    p.add_argument("--rescore", metavar="RECORDS", help="score saved records again (SLO, threshold, measure "
                   "from the flags) without running anything")
    p.add_argument("--published", action="store_true",
                   help="run the published side-by-side run (load_tests/published.py; refreshes docs/benchmarks.md)")
    p.add_argument("--out", help="--published (default docs/results) and --sweep slo (default "
                                 "docs/results/slo-sweep): where their files go")
    p.add_argument("--quick", action="store_true", help="a short run (tests): 1 seed, few requests; "
                   "with --published its quick preset")
    p.add_argument("--short", action="store_true", help="--published: the reduced preset (~35 min on 2 "
                   "shared cores: 60 requests per point, a fixed 4-rate grid that token and request extend "
                   "by doubling until token misses, no ablations/models sweep)")
    p.add_argument("--gpu", action="store_true", help="--published: the GPU preset (8 copies of a 7B shape, "
                   "random bf16 weights, one CUDA device; tests/gpu/run.sh runs it)")
    p.add_argument("--skip-models-sweep", action="store_true", help="--published: leave out the models "
                   "sweep (~15 min; `--sweep models` measures it on its own with the same settings)")
    p.add_argument("--resume", action="store_true", help="--published: continue the run whose records are in "
                   "--out (its SLO, its measured points; only what is missing is measured)")
    p.add_argument("--no-quota-cap", action="store_true",
                   help="token contender: Aegaeon's fixed Q_max, no cap at a multiple of the switch cost")
    p.add_argument("--no-overload-control", action="store_true",
                   help="token contender: every batch shares the device even when alpha > 1")
    p.add_argument("--no-ttft-slack", action="store_true",
                   help="token contender: switches by its quota rule alone, without the waiting "
                        "requests' TTFT slack (scheduler/ttft_slack.py)")
    p.add_argument("--arrival", choices=("gamma", "poisson", "onoff"), default="gamma")
    p.add_argument("--cv", type=float, default=4.0, help="Gamma arrivals: coefficient of variation")
    # Zipf by default: Aegaeon's calibrated long tail (94.1% of models get 1.35% of requests)
    # gives the head model 98.7% of the requests when only 8 models are served.
    p.add_argument("--popularity", choices=("longtail", "zipf", "uniform"), default="zipf")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--lengths", default="azure",
                   help="azure (conv.csv), lognormal, or a trace CSV (Aegaeon, Azure, BurstGPT) whose "
                        "(input, output) pairs are resampled, scaled and clipped as for azure")
    p.add_argument("--input-scale", type=float, default=0.125)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--model-counts", type=_csv(int), default=[2, 4, 6, 8, 10, 12, 14, 16])
    p.add_argument("--model-rate", type=float, default=0.1, help="models sweep: req/s per model")
    p.add_argument("--device-counts", type=_csv(int), default=[1, 2, 3, 4, 6, 8],
                   help="--sweep devices: the device counts to try, ascending")
    p.add_argument("--device-slowdown", type=float, default=1.0,
                   help="each worker a virtual device this many times slower than its CPU thread, so more "
                        "devices than cores run at their own pace (actors/device_pace.py); default 1: none")
    p.add_argument("--threads-per-worker", type=int, help="default: cores // workers")
    p.add_argument("--via", choices=("engine", "http"), default="engine",
                   help="engine: straight to DeviceWorker actors (an ablation); http: token and request each "
                        "brought up as the Serve app (HTTP edge, router, workers) and driven over HTTP")
    p.add_argument("--progress", action="store_true", help="progress bar per measured point")


# ---------------------------------------------------------------- the command


def run(args) -> int:
    if args.published:
        from load_tests.published import BENCHMARKS_DOC, run_published

        summary = run_published(args.out or "docs/results", quick=args.quick, gpu=args.gpu, short=args.short,
                                readme=None if (args.gpu or args.quick) else BENCHMARKS_DOC,
                                sweep_models=not args.skip_models_sweep, resume=args.resume)
        print(json.dumps({k: v for k, v in summary.items() if k != "meta"}, indent=2, default=str))
        return 0
    if args.rescore:
        return rescore(args)
    if "slo" in args.sweep:
        if args.sweep != ["slo"]:
            raise ValueError(f"--sweep slo runs alone, got --sweep {','.join(args.sweep)}")
        from load_tests.slo_sweep import run_from_args

        return run_from_args(args)
    if "devices" in args.sweep:
        from load_tests.device_sweep import run_from_args as run_devices

        return run_devices(args)
    if args.url:   # the CLI sends --url to load_tests/url_load.py (which builds on this module)
        raise ValueError("--url runs through `tokenmux loadtest` (load_tests.url_load.run_url)")
    if args.via == "http" and set(args.contenders) - {"token", "request"}:
        raise ValueError(f"--via http runs token and request through the Serve app, got --contenders "
                         f"{','.join(args.contenders)}")
    from load_tests.analysis import analyze_trace
    from load_tests.contenders import CONTENDERS, Deployment
    from load_tests.driver import StopSignal
    from load_tests.experiment import Experiment, trace_spec
    from load_tests.search import SearchPlan
    from scheduler.slo import SLO

    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.contenders:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    bad_sweeps = [s for s in args.sweep if s not in ("rate", "models")]
    if bad_sweeps:
        raise ValueError(f"--sweep takes rate and/or models, got {bad_sweeps}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must list distinct seeds, got {args.seeds}")
    seeds = tuple(args.seeds[:1]) if args.quick else tuple(args.seeds)
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
    models = served_models(args.models, args.checkpoint)
    names = list(models)

    from cluster.ray_runtime import connect_or_start

    connect_or_start(num_virtual_gpus=max(args.workers, 1), log_to_driver=False)
    slo_info = measured_slo(models, args, threads)
    slo = SLO(slo_info["ttft_s"], slo_info["tbt_s"])
    settings = run_settings(args)
    trace = trace_spec(args)
    deployment = Deployment(models, args.workers, engine_config(models, args), threads, slo)
    ex = Experiment(deployment, args, settings, seeds=seeds, metric=args.sweep_metric,
                    scheduler=scheduler_overrides(args), via=args.via)
    if args.via == "http":
        from load_tests.contenders import free_loopback_port

        ex.http_port = free_loopback_port()
    first = ex.sample(trace, seeds[0])
    names = [m for m in first.models] + [m for m in names if m not in first.models]  # popular first
    deployment = Deployment({m: models[m] for m in names}, args.workers, deployment.engine, threads, slo)
    ex.deployment = deployment
    from load_tests.sweep import base_rate

    ref_rate = args.rate or (base_rate(first) if args.trace else 1.0)
    rates = sorted(set(args.rates or [ref_rate * k for k in RATE_STEPS]) | {ref_rate}) \
        if "rate" in args.sweep and not args.search else [ref_rate]
    from load_tests.provenance import provenance
    from load_tests.regime import regime

    started = provenance(torch_threads=threads)
    predicted = regime(list(first), slo, slo_info["derived_from"]["decode_s"])   # said before measuring
    ex.stop = StopSignal()
    with ex.stop.installed():
        if args.search and "rate" in args.sweep:   # the search picks rates per contender: one after another
            paired = {"notes": [], "descriptions": {}, "warm_up_errors": {}, "order": []}
            for name in args.contenders:
                with ex.session(name) as session:
                    paired["notes"] += session.contender.notes(deployment)
                    paired["descriptions"][name] = session.contender.describe(deployment)
                    session.search(trace, SearchPlan(start=ref_rate, threshold=args.threshold,
                                                     resolution=args.resolution))
                    paired["warm_up_errors"][name] = {m: e for m, e in session.warm_up_errors.items() if e}
        else:
            paired = ex.run_paired(trace, args.contenders, rates)
    ex.records.run = {"slo": slo_info, "deployment": {"models": deployment.models, "num_workers": args.workers,
                                                      "threads_per_worker": threads, "engine": deployment.engine,
                                                      "via": args.via},
                      "workload": {"trace": args.trace, "arrival": args.arrival, "cv": args.cv,
                                   "popularity": args.popularity, "lengths": args.lengths,
                                   "max_requests_per_point": None if settings.sustain else args.max_requests,
                                   "seeds": list(seeds)},
                      "sustain": settings.sustain.to_dict() if settings.sustain else None,
                      "scheduler": scheduler_overrides(args), "provenance": started}
    result = analyze_trace(ex.records, trace.name, slo, args.threshold, args.sweep_metric,
                           devices={c: deployment.devices(c) for c in args.contenders})
    out = {**result, **ex.records.run, "slo": slo_info, "reference_rate": ref_rate, "seeds": list(seeds),
           "notes": paired["notes"], "descriptions": paired["descriptions"],
           "warm_up_errors": paired["warm_up_errors"], "order": paired["order"], "regime": predicted,
           "interrupted": ex.stopped}
    for name, data in out["contenders"].items():
        data["at_reference_rate"] = _at_rate(data, ref_rate)
    if "models" in args.sweep:
        best, by_count = _models_sweep(args, models, threads, slo, settings)
        out[f"max_models_per_worker_at_{round(args.threshold * 100)}"] = best
        out["models_sweep"] = {str(n): s for n, s in by_count.items()}
        out["models_sweep_rate_per_model"] = args.model_rate
    return write_outputs(args, ex, trace, out, _markdown(out))


def write_outputs(args, ex, trace, out: dict, markdown: str) -> int:
    """Records (--records, default beside --json), report and plots (--plots), JSON (--json);
    prints the report. Returns the exit status: 130 when the run was interrupted."""
    from load_tests.records import write_records

    records_path = args.records or (str(Path(args.json_path).with_suffix("")) + ".records.jsonl.gz"
                                    if args.json_path else None)
    if records_path:
        write_records(records_path, ex.records)
        out["records"] = records_path
    if args.plots and out["contenders"]:
        _plots(args.plots, ex, trace, out, markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=_jsonable) + "\n")
    print(markdown)
    return 130 if ex.stopped else 0


def rescore(args) -> int:
    """Score saved records under the SLO / threshold / measure of the flags; prints and writes JSON."""
    from load_tests.analysis import analyze_trace
    from load_tests.records import read_records
    from scheduler.slo import SLO

    records = read_records(args.rescore)
    measured = records.run.get("slo", {})
    if not measured and (args.slo_ttft is None or args.slo_tbt is None):
        raise ValueError(f"{args.rescore} does not say its SLO: give --slo-ttft and --slo-tbt")
    slo = SLO(args.slo_ttft or measured["ttft_s"], args.slo_tbt or measured["tbt_s"])
    out = {"rescored_from": args.rescore, "slo_driven_with": measured.get("ttft_s") and
           {"ttft_s": measured["ttft_s"], "tbt_s": measured["tbt_s"]},
           "traces": {t: analyze_trace(records, t, slo, args.threshold, args.sweep_metric)
                      for t in records.traces()}}
    text = json.dumps(out, indent=2, default=_jsonable)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    for trace, result in out["traces"].items():
        print(_markdown({**result, "slo": {**measured, "ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}}))
    return 0


def _at_rate(data: dict, rate: float) -> dict:
    closest = min(data["points"], key=lambda r: abs(float(r) - rate))
    p = data["points"][closest]
    row = {"rate": float(closest)}
    for m in ("goodput", "strict", "cumulative"):
        row[f"attainment_{m}"] = p[m]["mean"]
        row[f"attainment_{m}_ci"] = [p[m]["lo"], p[m]["hi"]]
    for key in ("goodput_rps", "strict_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "tbt_p50_s", "tbt_p99_s", "num_errors"):
        row[key] = p.get(key)
    row["num_requests"] = p["num_requests"]
    return row


def _plots(out_dir, ex, trace, out: dict, markdown: str) -> None:
    from load_tests.report import plot_attainment_bands, plot_cdfs

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    plot_attainment_bands(out, d / "attainment_vs_rate.png")
    plot_cdfs(ex.records, trace.name, out, d / "latency")
    (d / "report.md").write_text(markdown)


def _models_sweep(args, models, threads, slo, settings):
    """--sweep models: the token contender on one worker over --model-counts (increasing),
    --model-rate req/s per model, until the sweep measure misses the threshold."""
    from load_tests.experiment import TraceSpec, measure_model_count

    trace = TraceSpec("models", args.arrival, args.cv)
    seeds = tuple(args.seeds[:1]) if args.quick else tuple(args.seeds)
    best, by_count = None, {}
    for n in sorted(set(args.model_counts)):
        point, _ = measure_model_count(n, next(iter(models.values())), args, threads, slo, settings, seeds,
                                       args.sweep_metric, trace, args.model_rate)
        by_count[n] = point
        if point[args.sweep_metric]["mean"] < args.threshold:
            break
        best = n
    return best, by_count


def _markdown(out: dict) -> str:
    from load_tests.regime import describe as describe_regime
    from load_tests.report import _estimate_text, _goodput_by_rate, _ratio_text, never_below_lines, per_seed_text

    slo = out["slo"]
    lines = [f"## tokenmux load test: {out.get('trace')}", ""]
    prov = out.get("provenance") or {}
    if prov:
        m = prov.get("machine", {})
        lines += [f"Measured at {prov.get('revision', '?')[:12] if prov.get('revision') else '?'}"
                  f"{' (uncommitted changes)' if prov.get('dirty') else ''}, started {prov.get('started_at')}, on "
                  f"{m.get('cpu_model')} ({m.get('cores_usable')} usable cores, torch threads "
                  f"{m.get('torch_threads')}, load {', '.join(f'{x:.1f}' for x in m.get('load_avg', []))}): "
                  f"`{' '.join(prov.get('command', []))}`", ""]
    if out.get("regime"):
        lines += [describe_regime(out["regime"]), ""]
    sustain = out.get("sustain")
    if sustain:
        lines += [f"Sustained points: a {sustain['warmup_s']:g} s warm-up (not scored), then a scored window of "
                  f"max({sustain['sustain_s']:g} s, {sustain['sustain_requests']} requests / rate); a rate is "
                  "held when the queue (arrived, not finished) at the window's end is no longer than at its "
                  "start.", ""]
    if out.get("order"):
        lines += ["Order per seed (alternating): " + "; ".join(
            f"{o['seed']}: {' then '.join(o['contenders'])}" for o in out["order"]), ""]
    if out.get("interrupted"):
        lines += ["**Interrupted**: the run was stopped (Ctrl-C); what is below is what it measured.", ""]
    lines += [f"Measure for the search: {out.get('measure')}; threshold {out.get('threshold')}; "
              f"seeds {out.get('seeds', '?')}.", "",
              "| contender | devices | max rate goodput | strict | cumulative | at rate | goodput | strict | "
              "cumulative | TTFT p50 | TTFT p99 | TPOT p99 | TBT p99 |", "|---|" + "---|" * 12]
    for name, data in out["contenders"].items():
        rk = next(k for k in data if k.startswith("max_rate_at_"))
        ref = data.get("at_reference_rate") or {}
        cells = [_estimate_text(data[rk][m]) for m in ("goodput", "strict", "cumulative")]
        at = [f"{ref.get('rate', 0):.3g}"] + [f"{ref.get(f'attainment_{m}', 0):.3f}" for m in
                                               ("goodput", "strict", "cumulative")]
        lat = [f"{ref[k]:.3g}" if ref.get(k) is not None else "-" for k in
               ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "tbt_p99_s")]
        lines.append(f"| {name} | {data['devices']} | " + " | ".join(cells + at + lat) + " |")
    lines.append("")
    lines += _goodput_by_rate(out["contenders"])
    if "derived_from" in slo:
        t = slo["derived_from"]
        lines.append(f"SLO (same for every contender): TTFT {slo['ttft_s']} s, TBT {slo['tbt_s']} s; "
                     f"{slo.get('rule', '')}, measured with {t['num_threads']} thread(s): prefill "
                     f"{t['prefill_s']:.4f} s ({t['prompt_len']} tokens), decode {t['decode_s']:.4f} s "
                     f"(batch {t['batch_size']}), switch {t['switch_s']:.4f} s.")
        lines.append("")
    for key in [k for k in out if k.startswith("token_vs_") and "_rate" in k and
                (k.endswith("_rate") or k.endswith("_rate_strict"))]:
        seeds = per_seed_text(out, key)
        lines.append(f"- {key}: {_ratio_text(out, key)} ({out.get(key + '_kind')}; CI from "
                     f"{out.get(key + '_ci_from', 'bands')})" + (f"; per seed {seeds}" if seeds else ""))
    lines += never_below_lines(out)
    for key in [k for k in out if k.startswith("max_models_per_worker")]:
        lines.append(f"- {key}: {out[key]} (per-model rate {out.get('models_sweep_rate_per_model')} req/s)")
    lines += [f"- note: {n}" for n in out.get("notes", [])]
    return "\n".join(lines) + "\n"


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
