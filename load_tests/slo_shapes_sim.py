"""Token- vs request-level on one simulated device at several SLO shapes (prints JSON).

    python -m load_tests.slo_shapes_sim [--ratios 11,16,100] [--seeds 0,1,2] [--h2d-gbps 2000]

The load test's published setup, on the fleet simulator (the same policy code on a virtual
clock, deterministic): 12 models of one type on ONE device holding 2 of them, Zipf(1)
popularity, Azure conversation lengths, a bursty (Gamma CV 4) and a Poisson trace. The SLO
is derived as load_tests/slo.py derives the load test's (TBT = 5 x a decode step of 4
requests; TTFT = 20 x (prefill of a 128-token prompt + one swap-in), the "measured" shape)
and re-shaped to TTFT:TPOT = each of `--ratios` at the same TBT. `--h2d-gbps` sets the swap
speed (the CPU engines swap a tiny model in well under a decode step). For each trace,
shape and policy: goodput attainment (TTFT and mean TPOT within the SLO) per rate, mean
and 95% CI over the seeds, and the max rate at 90% (load_tests/stats.py).
"""
from __future__ import annotations

import argparse
import json
import sys


def _csv(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def _spec(args, arrival: str, seed: int):
    from cluster.planner.plan_cli import add_arguments, build_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan_args = parser.parse_args([
        "--models", str(args.models), "--popularity", "zipf", "--arrival", arrival, "--cv", "4",
        "--rate", "1", "--duration", "10", "--seed", str(seed), "--gpu", args.gpu,
        "--model-mix", f"{args.model_type}:1.0", "--slots", "2", "--h2d-gbps", str(args.h2d_gbps),
        "--replan-interval", "0", "--metric", "goodput"])   # scored by goodput: plan by mean TPOT too
    spec, _ = build_spec(plan_args)
    # the load test's lengths: Azure conversations x 0.125 (input) and x 0.25 (output), clipped at 256
    from dataclasses import replace

    from cluster.planner import workloads as w
    from cluster.planner.marketplace import AZURE_CONV
    from cluster.planner.traces import lengths_from_azure

    lengths = lengths_from_azure(AZURE_CONV, input_scale=0.125, output_scale=0.25, max_input=256, max_output=256)
    arrivals = w.Poisson(1.0) if arrival == "poisson" else w.Gamma(1.0, 4.0)
    names = sorted(spec.market.types)
    workload = w.generate(arrivals, w.Zipf(1.0), names, lengths, seed=seed, num_requests=args.requests)
    return replace(spec, workload=workload)


def measured_slo(spec) -> tuple[float, float]:
    """(TTFT, TBT) as load_tests/slo.py sets them from one model's step times."""
    market = spec.market
    model = next(iter(market.types))
    fit = market.fits[model]
    decode = fit.decode_s(4, 4 * 128)
    prefill = fit.prefill_prompts_s([128])
    switch = market.types[model].weight_bytes / spec.layout.device.h2d_bytes_per_s
    return 20.0 * (prefill + switch), 5.0 * decode


def service_rate(spec) -> float:
    """mu = 1 / (prefill of a 128-token prompt + mean output x one decode step), as
    published.service_rate: the rate axis' unit."""
    _, tbt = measured_slo(spec)
    mean_out = sum(r.output_len for r in spec.workload) / len(spec.workload)
    fit = spec.market.fits[next(iter(spec.market.types))]
    return 1.0 / (fit.prefill_prompts_s([128]) + mean_out * tbt / 5.0)


def attainment(spec, policy: str, rate: float, slo) -> float:
    from dataclasses import replace

    from cluster.planner.metrics import summarize
    from cluster.planner.simulator import simulate
    from load_tests.sweep import RunSettings, at_rate

    workload = at_rate(spec.workload, rate, RunSettings(max_requests=len(spec.workload)))
    fleet = replace(spec.fleet(policy, 1), slo=slo)
    result = simulate(workload, spec.market, fleet)
    return summarize(result.records, slo)["attainment_goodput"]


def main(argv=None) -> int:
    from load_tests.stats import max_rate, mean_ci
    from scheduler.slo import SLO

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", default="measured,16,100", help="TTFT:TPOT shapes ('measured': slo.py's)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policies", default="token,request")
    p.add_argument("--traces", default="gamma,poisson")
    p.add_argument("--models", type=int, default=12)
    p.add_argument("--requests", type=int, default=240, help="requests per point (seconds at 1 req/s)")
    p.add_argument("--model-type", default="qwen2.5-7b")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--h2d-gbps", type=float, default=2000.0)
    p.add_argument("--rate-factors", default="0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6,8",
                   help="rates as multiples of the service rate 1 / (prefill + mean output x decode step)")
    args = p.parse_args(argv)
    seeds = _csv(args.seeds, int)
    out = {"settings": vars(args), "traces": {}}
    for arrival in _csv(args.traces, str):
        specs = {s: _spec(args, arrival, s) for s in seeds}
        ttft, tbt = measured_slo(specs[seeds[0]])
        mu = service_rate(specs[seeds[0]])
        trace_out = out["traces"][arrival] = {"measured_slo": {"ttft_s": ttft, "tbt_s": tbt,
                                                              "ratio": ttft / tbt}, "shapes": {}}
        for ratio in _csv(args.ratios, str):
            slo = SLO(ttft if ratio == "measured" else float(ratio) * tbt, tbt)
            shape = trace_out["shapes"][ratio] = {"slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}}
            for policy in _csv(args.policies, str):
                curve = {}
                for f in _csv(args.rate_factors):
                    values = [attainment(specs[s], policy, f * mu, slo) for s in seeds]
                    curve[f * mu] = mean_ci(values)
                    if curve[f * mu].mean < 0.5:
                        break
                est = max_rate(curve)
                shape[policy] = {"max_rate": est.value, "ci": [est.lo, est.hi], "kind": est.kind,
                                 "curve": {f"{r:.4g}": round(c.mean, 4) for r, c in curve.items()}}
                print(f"{arrival} {ratio} {policy}: {est.value:.4g} [{est.lo}, {est.hi}] {est.kind}",
                      file=sys.stderr)
            if "token" in shape and "request" in shape:
                shape["token_over_request"] = shape["token"]["max_rate"] / shape["request"]["max_rate"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
