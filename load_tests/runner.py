"""`tokenmux loadtest`: arguments -> workload -> contenders one after another -> report.

    tokenmux loadtest --trace FILE.csv --contenders token,request,dedicated,multiplexed \
        --workers W --sweep rate --json OUT.json --plots DIR

Without --trace the workload is synthetic: Gamma arrivals (CV 4, bursty), Zipf(1) model
popularity (a long tail that still has several active models when only ~10 are served;
--popularity longtail gives Aegaeon's 94.1% / 1.35% calibration, which with 8 models sends
98.7% of requests to one model) and lengths resampled from the Azure LLM 2023
conversation trace, scaled and clipped to the tiny models' budget. Served models are n
copies of one zoo checkpoint under distinct names (each is a separate model to every
contender: its own weight slot, its own LRU entry), or a list of zoo names.

This module imports only the standard library at the top, so `tokenmux --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

MiB = 1 << 20
DATA_DIR = Path(os.environ.get("TOKENMUX_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")
AZURE_CONV = DATA_DIR / "traces" / "azure-llm-2023" / "conv.csv"
RATE_STEPS = (0.25, 0.5, 1.0, 2.0, 4.0)  # default sweep: these multiples of --rate


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace CSV (Aegaeon, Azure 2023 or BurstGPT); default: synthetic")
    p.add_argument("--contenders", type=_csv(str), default=["token", "request"],
                   help="comma list of token,request,dedicated,multiplexed (default token,request)")
    p.add_argument("--workers", type=int, default=2, help="devices (DeviceWorkers / replicas) per contender")
    p.add_argument("--sweep", type=_csv(str), default=[], help="comma list of rate,models (default: none)")
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
    p.add_argument("--max-requests", type=int, default=60, help="requests per measured point")
    p.add_argument("--duration", type=float, help="cut each point's arrivals after this many seconds")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in s (default: measured, see load_tests/slo.py)")
    p.add_argument("--slo-tbt", type=float, help="TBT SLO in s (default: measured)")
    p.add_argument("--threshold", type=float, default=0.9, help="attainment the sweeps look for")
    p.add_argument("--sweep-metric", choices=("strict", "cumulative"), default="strict")
    p.add_argument("--arrival", choices=("gamma", "poisson", "onoff"), default="gamma")
    p.add_argument("--cv", type=float, default=4.0, help="Gamma arrivals: coefficient of variation")
    # Zipf by default: Aegaeon's calibrated long tail (94.1% of models get 1.35% of requests)
    # gives the head model 98.7% of the requests when only 8 models are served.
    p.add_argument("--popularity", choices=("longtail", "zipf", "uniform"), default="zipf")
    p.add_argument("--zipf-alpha", type=float, default=1.0)
    p.add_argument("--lengths", choices=("azure", "lognormal"), default="azure")
    p.add_argument("--input-scale", type=float, default=0.125)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--model-counts", type=_csv(int), default=[2, 4, 6, 8, 10, 12, 14, 16])
    p.add_argument("--model-rate", type=float, default=0.1, help="models sweep: req/s per model")
    p.add_argument("--threads-per-worker", type=int, help="default: cores // workers")
    p.add_argument("--via", choices=("engine", "http"), default="engine",
                   help="engine: straight to DeviceWorker actors; http: through the Serve app (later)")
    p.add_argument("--progress", action="store_true", help="progress bar per measured point")


# ---------------------------------------------------------------- building blocks


def _checkpoint(name_or_dir: str) -> str:
    if Path(name_or_dir, "config.json").is_file():
        return str(Path(name_or_dir))
    from load_tests.zoo import ensure_model

    return str(ensure_model(name_or_dir))


def served_models(spec: str, checkpoint: str) -> dict[str, str]:
    """--models: "N" -> N names over one checkpoint; "a,b,c" -> those zoo models."""
    if spec.strip().isdigit():
        n = int(spec)
        if n < 1:
            raise ValueError(f"--models must be >= 1, got {n}")
        path = _checkpoint(checkpoint)
        stem = Path(path).name
        return {f"{stem}-{i:02d}": path for i in range(n)}
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(names)) != len(names):
        raise ValueError(f"--models lists a model twice: {names}")
    return {n: _checkpoint(n) for n in names}


def engine_config(models: dict[str, str], args) -> dict:
    """EngineConfig kwargs (without policy): a budget of KV + `slots` of the largest model."""
    from actors.model_spec import ModelSpec

    largest = max(ModelSpec.from_dir(p).weight_bytes for p in set(models.values()))
    kv = int(args.kv_mb * MiB) // 256 * 256
    slot = (largest + 4 * MiB) // 256 * 256  # margin for the 64-byte tensor alignment
    budget = int(args.budget * MiB) if args.budget else kv + args.slots * slot + 256
    if args.slots >= len(models):
        logger.warning("%d slots hold all %d models: no model ever has to be swapped in",
                       args.slots, len(models))
    return {"budget_bytes": budget, "kv_bytes": kv, "num_slots": args.slots,
            "slab_bytes": 4 * MiB, "host_kv_bytes": 128 * MiB}


def make_workload(args, names: list[str], rate: float, num_requests: int):
    from load_tests import workloads as w

    arrivals = {"gamma": lambda: w.Gamma(rate, args.cv), "poisson": lambda: w.Poisson(rate),
                "onoff": lambda: w.OnOff(rate * 4, on_s=5.0, off_s=15.0)}[args.arrival]()
    popularity = {"longtail": w.LongTail, "uniform": w.Uniform,
                  "zipf": lambda: w.Zipf(args.zipf_alpha)}[args.popularity]()
    if len(names) < 2 and args.popularity == "longtail":
        popularity = w.Uniform()
    limits = dict(input_scale=args.input_scale, output_scale=args.output_scale,
                  max_input=args.max_input, max_output=args.max_output)
    if args.lengths == "azure":
        if not AZURE_CONV.is_file():
            raise ValueError(f"Azure trace not found at {AZURE_CONV}; set TOKENMUX_DATA_DIR or use --lengths lognormal")
        from load_tests.traces import lengths_from_azure

        lengths = lengths_from_azure(AZURE_CONV, **limits)
    else:
        lengths = w.LogNormalLengths(**limits)
    return w.generate(arrivals, popularity, names, lengths, seed=args.seed, num_requests=num_requests)


def measured_slo(models: dict[str, str], args, threads: int) -> dict:
    from load_tests.slo import DEFAULT_TBT_FACTOR, DEFAULT_TTFT_FACTOR, default_slo, measure_step_times
    from actors.model_spec import ModelSpec

    largest = max(set(models.values()), key=lambda p: ModelSpec.from_dir(p).weight_bytes)
    import ray

    # Measured in a Ray worker process with one device's share of the cores, as the
    # contenders' workers run (same scheduling priority, same share of a busy machine).
    remote = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(measure_step_times)
    times = ray.get(remote.remote(largest, prompt_len=min(128, args.max_input), batch_size=4,
                                  num_decode_steps=32, num_threads=threads))
    slo = default_slo(times)
    return {"ttft_s": args.slo_ttft or slo.ttft_s, "tbt_s": args.slo_tbt or slo.tbt_s,
            "derived_from": times.to_dict(), "tbt_factor": DEFAULT_TBT_FACTOR,
            "ttft_factor": DEFAULT_TTFT_FACTOR,
            "rule": "TBT = tbt_factor x decode_s; TTFT = ttft_factor x (prefill_s + switch_s), "
                    "medians measured in a Ray worker with one device's share of the cores"}


def rate_ratio(rows: dict, a: str, b: str, key: str, rates: list[float]) -> tuple[float | None, str]:
    """max rate of a / max rate of b, and what kind of number that is."""
    if a not in rows or b not in rows:
        return None, "not measured"
    ra, rb = rows[a].get(key), rows[b].get(key)
    a_open = ra is not None and ra >= max(rates)  # never fell below: a lower bound
    if ra is None:
        return (0.0 if rb is not None else None), f"{a} misses the threshold at every rate"
    if rb is None:  # b fails even the lowest rate: its max rate is below it
        return ra / min(rates), f"lower bound: {b} misses the threshold at the lowest rate tested"
    return ra / rb, "lower bound: " + a + " met the threshold at every rate" if a_open else "measured"


# ---------------------------------------------------------------- the command


def run(args) -> int:
    if args.via == "http":
        raise ValueError("--via http needs the Serve app (deploy/); it is not wired in yet: use --via engine")
    from load_tests.contenders import CONTENDERS, Deployment, make_contender
    from load_tests.report import build_report, max_rate_at, to_markdown, write_report
    from load_tests.sweep import RunSettings, attainment_by_rate, model_count_sweep, rate_sweep
    from load_tests.traces import read_trace
    from scheduler.slo import SLO

    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.contenders:
        raise ValueError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    bad_sweeps = [s for s in args.sweep if s not in ("rate", "models")]
    if bad_sweeps:
        raise ValueError(f"--sweep takes rate and/or models, got {bad_sweeps}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
    models = served_models(args.models, args.checkpoint)
    names = list(models)

    from cluster.ray_runtime import connect_or_start

    connect_or_start(num_virtual_gpus=max(args.workers, 1), log_to_driver=False)
    slo_info = measured_slo(models, args, threads)
    slo = SLO(slo_info["ttft_s"], slo_info["tbt_s"])
    settings = RunSettings(max_requests=args.max_requests, duration_s=args.duration,
                           request_timeout_s=args.request_timeout, seed=args.seed, progress=args.progress)
    if args.trace:
        workload = read_trace(args.trace, deployed=names, seed=args.seed)
        ref_rate = args.rate or (len(workload) - 1) / max(workload.duration_s, 1e-9)
    else:
        ref_rate = args.rate or 1.0
        workload = make_workload(args, names, ref_rate, max(args.max_requests, 2))
    names = [m for m in workload.models] + [m for m in names if m not in workload.models]  # popular first
    deployment = Deployment({m: models[m] for m in names}, args.workers, engine_config(models, args),
                            threads, slo)
    rates = sorted(set(args.rates or [ref_rate * k for k in RATE_STEPS]) | {ref_rate}) \
        if "rate" in args.sweep else [ref_rate]

    summaries, sweeps, records, turns, notes, warm, all_points = {}, {}, {}, {}, [], {}, {}
    for name in args.contenders:
        contender = make_contender(name)
        notes += contender.notes(deployment)
        logger.info("contender %s: rates %s", name, [round(r, 3) for r in rates])
        points, warm[name] = rate_sweep(contender, deployment, workload, rates, settings)
        all_points[name] = points
        ref = points[min(points, key=lambda r: abs(r - ref_rate))]
        summaries[name], records[name], turns[name] = ref.summary, ref.records, ref.turns
        if "rate" in args.sweep:
            sweeps[name] = attainment_by_rate(points, args.sweep_metric)
        print(f"{name}: strict {ref.summary['attainment_strict']:.3f} at {ref.rate:.3g} req/s"
              + (f", sweep {sweeps[name]}" if name in sweeps else ""), file=sys.stderr)

    rows = build_report(summaries, sweeps=sweeps or None, threshold=args.threshold)
    rate_key = f"max_rate_at_{round(args.threshold * 100)}"
    out = {"slo": slo_info, "contenders": list(rows), "reference_rate": ref_rate, "rates": rates,
           "sweep_metric": args.sweep_metric, "threshold": args.threshold, "notes": notes,
           "deployment": {"models": deployment.models, "num_workers": args.workers,
                          "threads_per_worker": threads, "engine": deployment.engine},
           "workload": {"trace": args.trace, "arrival": args.arrival, "cv": args.cv,
                        "popularity": args.popularity, "lengths": args.lengths,
                        "max_requests_per_point": args.max_requests, "seed": args.seed},
           "warm_up_errors": {c: {m: e for m, e in w.items() if e} for c, w in warm.items()}}
    for name, row in rows.items():
        row.setdefault(rate_key, None)
        out[name] = row
    for other in ("request", "multiplexed", "dedicated"):
        out[f"token_vs_{other}_rate"], out[f"token_vs_{other}_rate_kind"] = rate_ratio(
            rows, "token", other, rate_key, rates)
    if "rate" in args.sweep:   # the same points judged by the other attainment measure, side by side
        alt_metric = "cumulative" if args.sweep_metric == "strict" else "strict"
        alt_rows = {}
        for name, points in all_points.items():
            alt = attainment_by_rate(points, alt_metric)
            alt_rows[name] = {rate_key: max_rate_at(alt, args.threshold)}
            out[name][f"sweep_{alt_metric}"] = alt
            out[name][f"{rate_key}_{alt_metric}"] = alt_rows[name][rate_key]
        for other in ("request", "multiplexed", "dedicated"):
            if "token" in alt_rows and other in alt_rows:
                out[f"token_vs_{other}_rate_{alt_metric}"], out[f"token_vs_{other}_rate_{alt_metric}_kind"] = \
                    rate_ratio(alt_rows, "token", other, rate_key, rates)

    if "models" in args.sweep:
        best, by_count = _models_sweep(args, models, threads, slo, settings)
        out[f"max_models_per_worker_at_{round(args.threshold * 100)}"] = best
        out["models_sweep"] = {str(n): s for n, s in by_count.items()}
        out["models_sweep_rate_per_model"] = args.model_rate

    markdown = to_markdown(rows, "tokenmux load test") + _markdown_extra(out)
    if args.plots:
        write_report(args.plots, summaries, sweeps=sweeps or None, records=records, turns=turns,
                     threshold=args.threshold)
        (Path(args.plots) / "report.md").write_text(markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=_jsonable) + "\n")
    print(markdown)
    return 0


def _models_sweep(args, models, threads, slo, settings):
    from load_tests.contenders import Deployment, make_contender
    from load_tests.sweep import at_rate, model_count_sweep

    path = next(iter(models.values()))
    stem = Path(path).name

    def deployment_for(n: int) -> Deployment:
        ms = {f"{stem}-{i:02d}": path for i in range(n)}
        return Deployment(ms, 1, engine_config(ms, args), threads, slo)

    def workload_for(d: Deployment):
        # at_rate: a short bursty sample's own rate is far from the nominal one; scale it there
        rate = args.model_rate * len(d.models)
        return at_rate(make_workload(args, list(d.models), rate, max(args.max_requests, 2)), rate, settings)

    return model_count_sweep(lambda: make_contender("token"), deployment_for, workload_for,
                             args.model_counts, settings, threshold=args.threshold,
                             metric=args.sweep_metric)


def _markdown_extra(out: dict) -> str:
    slo = out["slo"]
    t = slo["derived_from"]
    lines = ["", f"SLO (same for every contender): TTFT {slo['ttft_s']} s, TBT {slo['tbt_s']} s; "
             f"{slo['rule']}, measured on this machine with {t['num_threads']} thread(s): "
             f"prefill {t['prefill_s']:.4f} s ({t['prompt_len']} tokens), decode {t['decode_s']:.4f} s "
             f"(batch {t['batch_size']}), switch {t['switch_s']:.4f} s.", ""]
    for key in ("token_vs_request_rate", "token_vs_multiplexed_rate", "token_vs_dedicated_rate"):
        if out.get(key + "_kind") != "not measured":
            lines.append(f"- {key}: {out.get(key)} ({out.get(key + '_kind')})")
    for key in [k for k in out if k.startswith("max_models_per_worker")]:
        lines.append(f"- {key}: {out[key]} (per-model rate {out['models_sweep_rate_per_model']} req/s)")
    lines += [f"- note: {n}" for n in out["notes"]]
    return "\n".join(lines) + "\n"


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
