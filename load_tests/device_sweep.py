"""`tokenmux loadtest --sweep devices`: the fewest devices at which each contender holds the
threshold (90% goodput) on one workload, measured on real workers, not simulated.

    tokenmux loadtest --sweep devices --device-counts 2,3,4,6,8 --rate 1 --models 32 \
        --device-slowdown 6 --contenders token,request ...

The workload is fixed (the trace's process at --rate, every model's share of it); the number
of devices grows. At each count every contender serves the same requests per seed (sustained
points, paired seeds in alternating order, as `--sweep rate`); a contender that held the
threshold at a count is not run at larger ones (more devices only add capacity).

How each contender uses its devices: both get the same fixed assignment of models to devices
(model i on device i mod n, popular first), so each device serves its share of the models
with its policy. Request-level keeps a model on its device while it has requests and runs
them to completion before the next model, as ServerlessLLM and Ray Serve multiplexing do;
token-level switches between the device's models every few decode steps. Neither pools a
model across devices here (the router that would, through `--via http`, is the next step).

On a small host the devices are paced (`--device-slowdown`, actors/device_pace.py): each
takes k x the CPU time of its work, so k devices share a core at the pace each would have
alone.

The fewest devices is read off the mean curve (attainment by count): the first count tested
whose mean meets the threshold. It is a measured value only at the grid's resolution (the
count below it was tested and missed); if no count meets it, a lower bound (more than the
largest tried). Token's devices / request's devices is reported with a paired bootstrap
over seeds and the ratio on each seed alone.
"""
from __future__ import annotations

import logging
import random
from typing import Mapping, Sequence

from load_tests.stats import LOWER_BOUND, MEASURED, UNDEFINED, UPPER_BOUND

logger = logging.getLogger(__name__)


def fewest_devices(curve: Mapping[int, float], threshold: float) -> dict:
    """The first device count (ascending) whose attainment meets `threshold`.

    Returns {value, kind, below}: kind MEASURED with `below` the largest count tested under it
    that missed (None: it is the smallest count tested, so an upper bound: at most value);
    LOWER_BOUND when no count meets it (more than value, the largest tried)."""
    if not curve:
        raise ValueError("fewest_devices needs at least one device count")
    counts = sorted(curve)
    for i, n in enumerate(counts):
        if curve[n] >= threshold:
            if i == 0:
                return {"value": n, "kind": UPPER_BOUND, "below": None}
            return {"value": n, "kind": MEASURED, "below": counts[i - 1]}
    return {"value": counts[-1], "kind": LOWER_BOUND, "below": counts[-1]}


def device_ratio(a: dict, b: dict) -> dict:
    """a's fewest devices / b's, censoring carried: {value, kind} (kind says what the value is)."""
    va, vb = a["value"], b["value"]
    kinds = {a["kind"], b["kind"]}
    if kinds <= {MEASURED}:
        return {"value": va / vb, "kind": MEASURED}
    # a is at most va (UPPER_BOUND) or more than va (LOWER_BOUND); the same for b
    a_le = a["kind"] in (MEASURED, UPPER_BOUND)
    b_ge = b["kind"] in (MEASURED, LOWER_BOUND)
    if a_le and b_ge:
        return {"value": va / vb, "kind": UPPER_BOUND}   # the ratio is at most this
    a_ge = a["kind"] in (MEASURED, LOWER_BOUND)
    b_le = b["kind"] in (MEASURED, UPPER_BOUND)
    if a_ge and b_le:
        return {"value": va / vb, "kind": LOWER_BOUND}   # at least this
    return {"value": None, "kind": UNDEFINED}


def paired_device_ratio(a: Mapping[int, Mapping[int, float]], b: Mapping[int, Mapping[int, float]],
                        threshold: float, reps: int = 2000, seed: int = 0) -> dict:
    """a's fewest devices / b's, each {seed: {count: attainment}}, over the seeds and counts
    both measured: the ratio of the mean curves', a paired bootstrap 95% interval (the same
    seeds drawn for both) and the ratio on each seed alone. Each contender's curve has the counts
    it ran (it stops at the first whose mean met the threshold): a draw or a seed that never
    meets it there gives a lower bound on that side."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("paired_device_ratio needs seeds both contenders measured")

    def mean(side, draw: Sequence[int]) -> dict[int, float]:   # over the counts the contender ran
        counts = set.intersection(*(set(side[s]) for s in draw))
        return {n: sum(side[s][n] for s in draw) / len(draw) for n in counts}

    def ratio(draw: Sequence[int]) -> dict:
        return device_ratio(fewest_devices(mean(a, draw), threshold), fewest_devices(mean(b, draw), threshold))

    whole = ratio(seeds)
    rng = random.Random(seed)
    draws = [ratio([seeds[rng.randrange(len(seeds))] for _ in seeds]) for _ in range(reps)]
    values = sorted(d["value"] for d in draws if d["value"] is not None)
    kinds = [d["kind"] for d in draws]
    return {**whole, "lo": values[int(0.025 * len(values))] if values else None,
            "hi": values[max(0, int(0.975 * len(values)) - 1)] if values else None,
            "censored_draws": sum(k != MEASURED for k in kinds), "reps": reps, "seeds": seeds,
            "per_seed": {str(s): ratio([s]) for s in seeds}}


def run_device_sweep(args, models: dict[str, str], threads: int, slo, settings, trace, seeds, engine: dict,
                     metric: str) -> dict:
    """Every contender at every count of args.device_counts (ascending) at args.rate, paired
    seeds; a contender stops at the first count whose mean meets the threshold. Returns the
    per-count summaries, the fewest devices per contender and the token / request ratio."""
    from cluster.planner.metrics import attainment_key
    from load_tests.analysis import point_summary
    from load_tests.contenders import Deployment
    from load_tests.experiment import Experiment

    rate = float(args.rate)
    left = list(args.contenders)
    by_count: dict[int, dict] = {}
    curves: dict[str, dict[int, dict[int, float]]] = {c: {} for c in args.contenders}
    records = {}
    for n in sorted(set(args.device_counts)):
        if not left:
            break
        deployment = Deployment(models, n, engine, threads, slo)
        ex = Experiment(deployment, args, settings, seeds=tuple(seeds), metric=metric)
        paired = ex.run_paired(trace, left, [rate])
        records[n] = ex.records
        row = {"order": paired["order"], "contenders": {}}
        for name in list(left):
            summary = point_summary(ex.records.select(name, trace.name)[rate], slo, rate, settings.sustain)
            row["contenders"][name] = summary
            for s, per in summary["per_seed"].items():
                curves[name].setdefault(int(s), {})[n] = per[attainment_key(metric)] or 0.0
            logger.info("%s on %d devices at %g req/s: %s %.3f", name, n, rate, metric, summary[metric]["mean"])
            if summary[metric]["mean"] >= args.threshold:
                left.remove(name)
        by_count[n] = row
    fewest = {}
    for name, per_seed in curves.items():
        mean = {n: by_count[n]["contenders"][name][metric]["mean"] for n in by_count
                if name in by_count[n]["contenders"]}
        fewest[name] = {**fewest_devices(mean, args.threshold),
                        "per_seed": {str(s): fewest_devices(c, args.threshold) for s, c in sorted(per_seed.items())}}
    out = {"rate": rate, "threshold": args.threshold, "measure": metric, "device_counts": sorted(by_count),
           "by_count": {str(n): row for n, row in by_count.items()}, "fewest_devices": fewest}
    if "token" in curves and "request" in curves and curves["token"] and curves["request"]:
        out["token_vs_request_devices"] = paired_device_ratio(curves["token"], curves["request"], args.threshold)
    return out, records


def markdown(out: dict) -> list[str]:
    """The device sweep's part of the load test's report."""
    s = out["device_sweep"]
    lines = [f"### Fewest devices at {s['threshold']:.0%} {s['measure']}, {s['rate']:g} req/s offered", "",
             "| devices | " + " | ".join(f"{c} goodput / strict (held)" for c in s["fewest_devices"]) + " |",
             "|---|" + "---|" * len(s["fewest_devices"])]
    for n, row in s["by_count"].items():
        cells = []
        for c in s["fewest_devices"]:
            p = row["contenders"].get(c)
            cells.append("-" if p is None else f"{p['goodput']['mean']:.3f} [{p['goodput']['lo']:.2f}, "
                         f"{p['goodput']['hi']:.2f}] / {p['strict']['mean']:.3f} "
                         f"({p.get('num_seeds_held', '?')}/{p['num_seeds']})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    for c, f in s["fewest_devices"].items():
        seeds = ", ".join(f"{k}: {_count_text(v)}" for k, v in f["per_seed"].items())
        lines.append(f"- {c}: fewest devices {_count_text(f)} (per seed {seeds})")
    r = s.get("token_vs_request_devices")
    if r:
        ci = f"[{r['lo']:.2f}, {r['hi']:.2f}]" if r["lo"] is not None else "[-]"
        per = ", ".join(f"{k}: {_ratio_text(v)}" for k, v in r["per_seed"].items())
        lines.append(f"- token / request devices: {_ratio_text(r)} {ci} (paired bootstrap over seeds "
                     f"{r['seeds']}, {r['censored_draws']} of {r['reps']} draws censored; per seed {per})")
    return lines + [""]


def _count_text(f: dict) -> str:
    return {MEASURED: f"{f['value']} (missed at {f['below']})", UPPER_BOUND: f"<= {f['value']}",
            LOWER_BOUND: f"> {f['value']}"}[f["kind"]]


def _ratio_text(r: dict) -> str:
    if r["value"] is None:
        return "undefined"
    return {MEASURED: f"{r['value']:.2f}", UPPER_BOUND: f"<= {r['value']:.2f}",
            LOWER_BOUND: f">= {r['value']:.2f}"}[r["kind"]]


def run_from_args(args) -> int:
    """`tokenmux loadtest --sweep devices`: the sweep, its JSON (provenance, regime, SLO), records
    per device count beside the JSON, and the report."""
    import json
    from pathlib import Path

    from cluster.ray_runtime import connect_or_start
    from load_tests.provenance import provenance
    from load_tests.records import write_records
    from load_tests.regime import describe as describe_regime, regime
    from load_tests.contenders import Deployment
    from load_tests.experiment import Experiment, trace_spec
    from load_tests.run_setup import engine_config, measured_slo, run_settings, served_models
    from scheduler.slo import SLO

    if args.sweep != ["devices"]:
        raise ValueError(f"--sweep devices runs alone, got --sweep {','.join(args.sweep)}")
    if args.rate is None or not args.device_counts or min(args.device_counts) < 1:
        raise ValueError("--sweep devices needs --rate and --device-counts of positive integers")
    if args.via != "engine" or set(args.contenders) - {"token", "request"}:
        raise ValueError("--sweep devices runs the token and request contenders engine-direct")
    seeds = tuple(args.seeds[:1]) if args.quick else tuple(args.seeds)
    threads = args.threads_per_worker or 1
    models = served_models(args.models, args.checkpoint)
    connect_or_start(num_virtual_gpus=max(args.device_counts), log_to_driver=False)
    started = provenance(torch_threads=threads)
    slo_info = measured_slo(models, args, threads)
    slo = SLO(slo_info["ttft_s"], slo_info["tbt_s"])
    settings, trace = run_settings(args), trace_spec(args)
    engine = engine_config(models, args)
    probe = Experiment(Deployment(models, 1, engine, threads, slo), args, settings, seeds=seeds)
    first = probe.point_workload(trace, seeds[0], float(args.rate))
    names = list(first.models) + [m for m in models if m not in first.models]   # popular first
    models = {m: models[m] for m in names}
    predicted = regime(list(first), slo, slo_info["derived_from"]["decode_s"])   # said before measuring
    workloads = {}
    if args.json_path:   # what each seed offers, as traces `tokenmux plan --trace` replays
        from cluster.planner.traces import write_aegaeon

        stem = str(Path(args.json_path).with_suffix(""))
        Path(stem).parent.mkdir(parents=True, exist_ok=True)
        workloads = {str(s): str(write_aegaeon(probe.point_workload(trace, s, float(args.rate)),
                                               f"{stem}.seed{s}.csv")) for s in seeds}
    sweep, records = run_device_sweep(args, models, threads, slo, settings, trace, seeds, engine, args.sweep_metric)
    out = {"trace": trace.name, "device_sweep": sweep, "slo": slo_info, "regime": predicted, "seeds": list(seeds),
           "deployment": {"models": models, "threads_per_worker": threads, "engine": engine, "via": "engine"},
           "workload": {"arrival": args.arrival, "cv": args.cv, "popularity": args.popularity,
                        "lengths": args.lengths, "input_scale": args.input_scale,
                        "output_scale": args.output_scale},
           "sustain": settings.sustain.to_dict() if settings.sustain else None, "provenance": started,
           "workload_files": workloads}
    if args.json_path:
        stem = str(Path(args.json_path).with_suffix(""))
        out["records"] = {}
        for n, recs in records.items():
            recs.run = {"slo": slo_info, "sustain": out["sustain"], "provenance": started,
                        "deployment": {**out["deployment"], "num_workers": n}}
            out["records"][str(n)] = str(write_records(f"{stem}.n{n}.records.jsonl.gz", recs))
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2, default=str) + "\n")
    text = "\n".join([f"## tokenmux load test: fewest devices ({trace.name})", "",
                      f"Measured at {started.get('revision', '?')}, started {started.get('started_at')}: "
                      f"`{' '.join(started.get('command', []))}`", "", describe_regime(predicted), "",
                      f"SLO: TTFT {slo.ttft_s:g} s, TBT {slo.tbt_s:g} s; device slowdown "
                      f"{engine.get('device_slowdown', 1.0):g}", ""] + markdown(out))
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        (Path(args.plots) / "report.md").write_text(text)
    print(text)
    return 0
