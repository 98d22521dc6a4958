"""`tokenmux loadtest --url URL`: any running OpenAI-compatible server, driven with a trace.

    tokenmux loadtest --url http://127.0.0.1:8000 --slo-ttft 2 --slo-tbt 0.1 \
        --trace /work/shared/data/traces/aegaeon-synth/synth-10-0.1-1-1.csv --rates 1,2,4 \
        --sustain-s 60 --seeds 0,1,2 --json out/server.json --plots out/server

Nothing is started: the server (tokenmux serve, vLLM, SGLang, ...) is already up. Each
request is streamed (`POST /v1/completions`, stream=true, `max_tokens` and `ignore_eos` from
the trace, see driver.OpenAIHTTPTarget); the client stamps the first token and every token
after it as they arrive, and keeps any error. Points are sustained (load_tests/sustained.py)
unless --burst; the workload is the trace's (a file of any schema of cluster/planner/traces.py,
or synthetic arrivals) over the server's models (`--served-models`, default its /v1/models).

Scores: per rate, goodput and strict attainment with CIs over seeds, whether the rate was
held, and the same per model. The run is bounded (each point's span, --request-timeout per
request, --max-duration for the whole run) and Ctrl-C safe: a SIGINT stops sending, cancels
the requests in flight and still writes what was measured (exit status 130).
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

CONTENDER = "server"


def server_models(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """The model ids a server lists at GET /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
    resp.raise_for_status()
    models = [m["id"] for m in resp.json().get("data", [])]
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; give --served-models")
    return models


def per_model(records, trace: str, sustain, slo) -> dict:
    """{rate: {model: goodput, strict, requests, errors}} over every seed's scored requests."""
    from cluster.planner.metrics import summarize

    out = {}
    for rate, seeds in records.select(CONTENDER, trace).items():
        pooled = [r for recs in seeds.values() for r in (sustain.scored(recs, rate) if sustain else recs)]
        if not pooled:
            continue
        models = summarize(pooled, slo)["per_model"]
        out[str(rate)] = {m: {"goodput": s["attainment_goodput"], "strict": s["attainment_strict"],
                              "num_requests": s["num_requests"], "num_errors": s["num_errors"],
                              "ttft_p99_s": s["ttft_p99_s"], "tpot_p99_s": s["tpot_p99_s"]}
                          for m, s in models.items()}
    return out


def per_model_lines(table: dict) -> list[str]:
    lines = ["Per model (all seeds pooled), goodput / strict (requests, errors):", "",
             "| req/s | model | goodput | strict | requests | errors |", "|---|---|---|---|---|---|"]
    for rate, models in table.items():
        for m, s in models.items():
            lines.append(f"| {float(rate):.3g} | {m} | {s['goodput']:.3f} | {s['strict']:.3f} | "
                         f"{s['num_requests']} | {s['num_errors']} |")
    return lines + [""]


def run_url(args) -> int:
    """The `--url` form of `tokenmux loadtest` (see the module docstring)."""
    from dataclasses import replace

    from load_tests.analysis import analyze_trace
    from load_tests.contenders import Deployment, UrlContender
    from load_tests.driver import StopSignal
    from load_tests.experiment import Experiment, trace_spec
    from load_tests.provenance import provenance
    from load_tests.regime import regime
    from load_tests.run_setup import run_settings
    from load_tests.runner import _at_rate, _markdown, write_outputs
    from scheduler.slo import SLO

    if args.slo_ttft is None or args.slo_tbt is None:
        raise ValueError("--url needs --slo-ttft and --slo-tbt: the SLO the server is judged by")
    rates = sorted(set(args.rates or ([args.rate] if args.rate else [])))
    if not rates:
        raise ValueError("--url needs --rate or --rates (req/s)")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must list distinct seeds, got {args.seeds}")
    seeds = tuple(args.seeds[:1]) if args.quick else tuple(args.seeds)
    slo = SLO(args.slo_ttft, args.slo_tbt)
    contender = UrlContender(args.url, CONTENDER, api_key=args.api_key, ignore_eos=not args.no_ignore_eos)
    models = args.served_models or server_models(args.url, args.api_key)
    settings = run_settings(args)
    if args.prompt == "text":
        settings = replace(settings, vocab_size=None)
    trace = trace_spec(args)
    deployment = Deployment({m: args.url for m in models}, 1, {}, 1, slo)
    ex = Experiment(deployment, args, settings, seeds=seeds, metric=args.sweep_metric, stop=StopSignal())
    started = provenance()
    timer = threading.Timer(args.max_duration, ex.stop.set) if args.max_duration else None
    if timer:
        timer.daemon = True
        timer.start()
    try:
        with ex.stop.installed(), ex.session(CONTENDER, contender) as session:
            for rate in rates:
                session.point(trace, rate)
                if ex.stopped:
                    break
            warm = {m: e for m, e in session.warm_up_errors.items() if e}
    finally:
        if timer:
            timer.cancel()
    ex.records.run = {"slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s, "rule": "given (--slo-ttft, --slo-tbt)"},
                      "url": args.url, "models": models,
                      "workload": {"trace": args.trace, "arrival": args.arrival, "cv": args.cv,
                                   "popularity": args.popularity, "lengths": args.lengths, "seeds": list(seeds),
                                   "prompt": args.prompt, "ignore_eos": not args.no_ignore_eos},
                      "sustain": settings.sustain.to_dict() if settings.sustain else None, "provenance": started}
    result = analyze_trace(ex.records, trace.name, slo, args.threshold, args.sweep_metric)
    out = {**result, **ex.records.run, "seeds": list(seeds), "reference_rate": rates[0],
           "warm_up_errors": warm, "interrupted": ex.stopped,
           "per_model": per_model(ex.records, trace.name, settings.sustain, slo),
           "descriptions": {CONTENDER: contender.describe(deployment)}}
    for data in out["contenders"].values():
        data["at_reference_rate"] = _at_rate(data, rates[0])
        step = data["at_reference_rate"].get("tpot_p50_s")
        if step:   # the server's step time is not known before: its TPOT at the lowest rate stands in
            out["regime"] = regime(list(ex.point_workload(trace, seeds[0], rates[0])), slo, step)
            out["regime"]["when"] = "the decode step read from the server's median TPOT at the lowest rate"
    markdown = _markdown(out) + "\n" + "\n".join(per_model_lines(out["per_model"]))
    return write_outputs(args, ex, trace, out, markdown)
