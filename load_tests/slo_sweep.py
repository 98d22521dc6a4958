"""The SLO sweep (`tokenmux loadtest --sweep slo`): every contender re-run, not re-scored, at
each SLO shape derived from the measured SLO, on both published traces.

    tokenmux loadtest --sweep slo [--slo-shapes measured,ttft:tpot=100] \\
        [--contenders token,request,multiplexed-8] [--seeds 0,1,2] [--out docs/results/slo-sweep]

The published run (load_tests/published.py) schedules for the measured SLO and re-scores its
records under other SLOs, but the token-level policy reads the SLO it is given (the quota
rule's TBT, the TTFT slack's deadlines), so a re-score judges a schedule made for another
SLO. Here each shape's SLO is the deployment's, so it rides on every GenerateRequest the
engines get (the Serve peer takes none: it has no SLO to read). Shapes (analysis.slo_variants):
the measured SLO; TTFT = 16 and 100 x TBT at the measured TBT; both scaled x0.5 and x2.

Per shape and trace, the reduced preset's grid (Preset.short): fixed fractions of the
service rate mu; token doubles past them until its mean misses (up to the preset's cap);
request runs token's rates, then doubles on until it misses too (same cap), so both
crossings are measured where the cap allows; the Serve peer, when asked, runs the fixed grid.
mu and each seed's workload are the same at every shape, so rates line up across shapes.

Files in the output folder: measured-slo.json (the base SLO; a later invocation into the
same folder reuses it, so shapes run apart derive from one SLO), per shape SLUG.json (both
traces: max rate at 90% goodput per contender with CIs, token/request and token/best-peer
ratios, token_never_below_request, the SLO each contender's requests carried, the full
analysis) and SLUG.records.jsonl.gz (every request; `tokenmux loadtest --rescore` reads it),
slo-sweep-summary.json and slo-sweep-report.md over every shape file in the folder, with the
floors. A shape whose JSON is already there is not run again.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from load_tests.published import Preset, grid_until_miss, service_rate, workload_args, _per_trace, _round

logger = logging.getLogger(__name__)

SHAPES = ("measured", "ttft:tpot=16", "ttft:tpot=100", "x0.5", "x2")
BASE_SLO = "measured-slo.json"
SUMMARY = "slo-sweep-summary.json"
REPORT = "slo-sweep-report.md"
PEER_PREFIX = "multiplexed"
RATE_KEY = "max_rate_at_90"
# the floors, checked by goodput: (shape, key, at least); never-below at every shape
RATIO_FLOORS = (("measured", "token_vs_request_rate", 2.0), ("ttft:tpot=100", "token_vs_request_rate", 1.0),
                (None, "token_vs_multiplexed_rate", 3.0))


def quick_preset() -> Preset:
    """The sweep's code paths in about a minute (tests): 3 models, 1 seed x 4 requests, one rate."""
    return Preset(models=3, seeds=(0,), max_requests=4, fixed_fractions=(0.5,), extend_until_miss=None,
                  settle_s=0.2, models_sweep=False)


def slug(shape: str) -> str:
    return shape.replace(":", "-").replace("=", "-")


def shape_slos(measured, shapes=SHAPES) -> dict:
    """shape name -> SLO, derived from the measured SLO (analysis.slo_variants)."""
    from load_tests.analysis import slo_variants

    variants = slo_variants(measured)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        raise ValueError(f"unknown SLO shapes {unknown}; choose from {', '.join(SHAPES)}")
    return {s: variants[s] for s in shapes}


def check_contenders(contenders) -> tuple[str, ...]:
    """token first, then request and Serve peers (multiplexed-N); the others have no place here."""
    from load_tests.contenders import MULTIPLEXED

    allowed = ("token", "request", *MULTIPLEXED)
    bad = [c for c in contenders if c not in allowed]
    if bad or "token" not in contenders or len(set(contenders)) != len(contenders):
        raise ValueError(f"the SLO sweep runs token and any of request, {', '.join(MULTIPLEXED)} "
                         f"(each once), got {list(contenders)}")
    return ("token", *[c for c in contenders if c != "token"])


def run_slo_sweep(out_dir: str | Path, *, preset: Preset | None = None, shapes=SHAPES,
                  contenders=("token", "request"), scheduler: dict | None = None) -> dict:
    """Run every shape not yet in out_dir, then summarise the folder; returns the summary.
    scheduler: SchedulerConfig fields of the token contender (the ablation flags)."""
    from cluster.ray_runtime import connect_or_start
    from load_tests.experiment import TraceSpec, write_json
    from load_tests.run_setup import served_models
    from scheduler.slo import SLO

    p = preset or Preset.short()
    contenders = check_contenders(contenders)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = workload_args(p)
    connect_or_start(num_virtual_gpus=1, log_to_driver=False)
    models = served_models(str(p.models), p.checkpoint)
    base = _base_slo(out, models, args, p)
    traces = [t for t in (TraceSpec("bursty", "gamma", 4.0), TraceSpec("poisson", "poisson")) if t.name in p.traces]
    for shape, slo in shape_slos(SLO(base["ttft_s"], base["tbt_s"]), shapes).items():
        path = out / f"{slug(shape)}.json"
        if path.is_file():
            logger.info("%s: %s is there, not run again", shape, path)
            continue
        write_json(path, run_shape(shape, slo, p, models, base, traces, contenders, out, scheduler))
    summary = summarize_folder(out)
    write_json(out / SUMMARY, summary)
    (out / REPORT).write_text(report_markdown(summary))
    return summary


def _base_slo(out: Path, models: dict, args, p: Preset) -> dict:
    """The folder's measured SLO: read back when an earlier invocation measured it, else measured."""
    from load_tests.experiment import write_json
    from load_tests.run_setup import measured_slo

    path = out / BASE_SLO
    if path.is_file():
        base = json.loads(path.read_text())
        if (base.get("checkpoint"), base.get("threads")) != (p.checkpoint, p.threads):
            raise ValueError(f"{path} was measured for {base.get('checkpoint')} with {base.get('threads')} "
                             f"thread(s), not {p.checkpoint} with {p.threads}: use another --out")
        logger.info("measured SLO from %s: TTFT %.4g s, TBT %.4g s", path, base["ttft_s"], base["tbt_s"])
        return base
    base = {**measured_slo(models, args, p.threads), "checkpoint": p.checkpoint, "threads": p.threads}
    write_json(path, base)
    return base


def run_shape(shape: str, slo, p: Preset, models: dict, base: dict, traces, contenders, out: Path,
              scheduler: dict | None = None) -> dict:
    """Every contender on every trace with `slo` given to the engines; the shape's JSON."""
    from load_tests.analysis import analyze_trace
    from load_tests.contenders import Deployment
    from load_tests.experiment import Experiment
    from load_tests.records import write_records
    from load_tests.run_setup import engine_config
    from load_tests.sweep import RunSettings

    t0 = time.time()
    args = workload_args(p)
    timeout = max(2.0, p.request_timeout_factor * (slo.ttft_s + p.max_output * slo.tbt_s))
    settings = RunSettings(max_requests=p.max_requests, request_timeout_s=timeout, settle_s=p.settle_s,
                           idle_skip_s=p.idle_skip_s)
    deployment = Deployment(models, 1, engine_config(models, args), p.threads, slo)
    ex = Experiment(deployment, args, settings, seeds=p.seeds, metric=p.metric, scheduler=dict(scheduler or {}))
    mu = service_rate(base["derived_from"], ex, traces)
    slo_dict = {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}
    ex.records.run = {"shape": shape, "slo": slo_dict, "measured_slo": base, "preset": asdict(p),
                      "request_timeout_s": timeout, "service_rate_rps": mu,
                      "deployment": {"models": models, "num_workers": 1, "threads_per_worker": p.threads,
                                     "engine": deployment.engine},
                      "traces": [t.describe() for t in traces], "workload": vars(args), "scheduler": ex.scheduler}
    records = out / f"{slug(shape)}.records.jsonl.gz"
    rates: dict[str, dict[str, list[float]]] = {t.name: {} for t in traces}
    given: dict[str, dict | None] = {}
    logger.info("shape %s: TTFT %.4g s, TBT %.4g s", shape, slo.ttft_s, slo.tbt_s)
    for name in contenders:
        with ex.session(name) as s:
            for t in traces:
                fixed = tuple(_per_trace(p.fixed_fractions, t.name))
                cap = _per_trace(p.extend_until_miss, t.name)
                if name == "token":
                    measured = grid_until_miss(lambda r: s.point(t, r), fixed, mu, p.threshold, cap)
                elif name == "request":   # token's rates, then on until it misses too
                    measured = grid_until_miss(lambda r: s.point(t, r), _fractions(fixed, rates[t.name]["token"]),
                                               mu, p.threshold, cap)
                else:   # the Serve peer: the fixed grid
                    measured = [_round(f * mu) for f in fixed]
                    for r in measured:
                        s.point(t, r)
                rates[t.name][name] = measured
            target_slo = getattr(s.target, "slo", None)   # what the contender put on each request
            given[name] = None if target_slo is None else {"ttft_s": target_slo.ttft_s, "tbt_s": target_slo.tbt_s}
        write_records(records, ex.records)
    result = {"shape": shape, "slo": slo_dict, "measured_slo": {k: base[k] for k in ("ttft_s", "tbt_s")},
              "contenders": list(contenders), "slo_given_to_engines": given,
              "slo_given_note": "the SLO each contender's requests carried (null: the contender takes none)",
              "scheduler": ex.scheduler, "seeds": list(p.seeds), "max_requests_per_point": p.max_requests,
              "service_rate_rps": mu,
              "request_timeout_s": timeout, "records": records.name, "traces": {}}
    for t in traces:
        analysis = analyze_trace(ex.records, t.name, slo, p.threshold, p.metric)
        result["traces"][t.name] = {**headline(analysis, p.metric), "rates": rates[t.name], "analysis": analysis}
    result["elapsed_s"] = round(time.time() - t0, 1)
    logger.info("shape %s done in %.0f s", shape, result["elapsed_s"])
    return result


def _fractions(fixed: tuple[float, ...], token_rates: list[float]) -> list[float]:
    """The fractions of mu behind token's rates (grid_until_miss: the fixed ones, then doublings)."""
    extra = len(token_rates) - len(fixed)
    return [*fixed, *(fixed[-1] * 2 ** k for k in range(1, extra + 1))]


def headline(analysis: dict, metric: str = "goodput") -> dict:
    """Max rate at 90% by `metric` per contender, the token ratios and never-below, of one trace."""
    out = {"max_rate": {name: data[RATE_KEY][metric] for name, data in analysis["contenders"].items()},
           "best_multiplexed": analysis.get("best_multiplexed")}
    for key in ("token_vs_request_rate", "token_vs_multiplexed_rate"):
        if key in analysis:
            out[key] = {"value": analysis[key], "kind": analysis[f"{key}_kind"], "ci": analysis[f"{key}_ci"]}
    if "token_never_below_request" in analysis:
        out["token_never_below_request"] = analysis["token_never_below_request"]
    return out


def summarize_folder(out: Path) -> dict:
    """Every shape JSON in `out`, in SHAPES order, with the floors."""
    shapes = {}
    for shape in SHAPES:
        path = out / f"{slug(shape)}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            shapes[shape] = {k: data[k] for k in ("slo", "contenders", "slo_given_to_engines", "seeds",
                                                  "max_requests_per_point", "elapsed_s", "records")}
            shapes[shape]["traces"] = {t: {k: v for k, v in row.items() if k != "analysis"}
                                       for t, row in data["traces"].items()}
    return {"measure": "goodput", "threshold": 0.9, "shapes": shapes, "floors": floors(shapes)}


def floors(shapes: dict) -> list[dict]:
    """The issue's floors at the shapes measured: met by the estimate, and beyond its CI."""
    rows = []
    for shape, data in shapes.items():
        for trace, row in data["traces"].items():
            if "token_never_below_request" in row:
                rows.append({"shape": shape, "trace": trace, "floor": "token_never_below_request",
                             "met": bool(row["token_never_below_request"])})
            for where, key, least in RATIO_FLOORS:
                ratio = row.get(key)
                if ratio is None or where not in (None, shape):
                    continue
                value, (lo, _) = ratio["value"], ratio["ci"]
                met = value is not None and value >= least and ratio["kind"] != "upper bound"
                rows.append({"shape": shape, "trace": trace, "floor": f"{key} >= {least:g}", "value": value,
                             "kind": ratio["kind"], "ci": ratio["ci"], "met": met,
                             "met_beyond_ci": met and lo is not None and lo >= least})
    return rows


def report_markdown(summary: dict) -> str:
    """One table per trace: a row per shape (max rate at 90% goodput, ratios, never-below)."""
    from load_tests.report import _estimate_text, _ratio_text

    lines = ["Max rate at 90% goodput, req/s: mean-curve crossing [95% CI] over the seeds; every "
             "contender run with the shape's SLO.", ""]
    traces = list(dict.fromkeys(t for d in summary["shapes"].values() for t in d["traces"]))
    for trace in traces:
        names = list(dict.fromkeys(n for d in summary["shapes"].values()
                                   for n in d["traces"].get(trace, {}).get("max_rate", {})))
        lines += [f"### {trace}", "",
                  "| SLO | TTFT s | TBT s | " + " | ".join(names) + " | token / request | token / best peer | "
                  "token never below request |", "|---|---|---|" + "---|" * (len(names) + 3)]
        for shape, data in summary["shapes"].items():
            row = data["traces"].get(trace)
            if row is None:
                continue
            cells = [_estimate_text(row["max_rate"][n]) if n in row["max_rate"] else "-" for n in names]
            ratios = [_ratio_text(_flat(row, k), k) if k in row else "-"
                      for k in ("token_vs_request_rate", "token_vs_multiplexed_rate")]
            lines.append(f"| {shape} | {data['slo']['ttft_s']:.4g} | {data['slo']['tbt_s']:.4g} | "
                         + " | ".join(cells + ratios) + f" | {row.get('token_never_below_request', '-')} |")
        lines.append("")
    lines += ["Floors (goodput):", ""]
    for f in summary["floors"]:
        extra = "" if "value" not in f else f" ({f['value'] if f['value'] is None else round(f['value'], 3)} " \
            f"{f['kind']}, CI {[None if c is None else round(c, 3) for c in f['ci']]}; beyond the CI: {f['met_beyond_ci']})"
        lines.append(f"- {f['shape']}, {f['trace']}: {f['floor']}: {'met' if f['met'] else 'not met'}{extra}")
    return "\n".join(lines) + "\n"


def _flat(row: dict, key: str) -> dict:
    """A headline ratio in the shape report._ratio_text reads (value, _kind, _ci beside the key)."""
    r = row[key]
    return {key: r["value"], f"{key}_kind": r["kind"], f"{key}_ci": r["ci"]}


def run_from_args(args) -> int:
    """`tokenmux loadtest --sweep slo`: the reduced preset (--quick: quick_preset), --seeds,
    --max-requests, --contenders, --slo-shapes, into --out (default docs/results/slo-sweep)."""
    from load_tests.run_setup import scheduler_overrides

    if args.quick:
        p = replace(quick_preset(), seeds=tuple(args.seeds[:1]))
    else:
        p = replace(Preset.short(), seeds=tuple(args.seeds), max_requests=args.max_requests)
    summary = run_slo_sweep(args.out or "docs/results/slo-sweep", preset=p, shapes=tuple(args.slo_shapes),
                            contenders=tuple(args.contenders), scheduler=scheduler_overrides(args))
    print(report_markdown(summary))
    return 0
