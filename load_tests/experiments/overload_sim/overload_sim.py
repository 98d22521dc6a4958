"""Token- vs request-level past capacity on the fleet simulator (issue 42), printed as JSON.

    PYTHONPATH=. .venv/bin/python load_tests/experiments/overload_sim/overload_sim.py [--traces gamma,poisson] \
        [--ratios measured,16,100] [--rate-factors 0.5,1,2,4,8] [--seeds 0,1,2,3,4] [--requests 240]

The setup of load_tests/slo_shapes_sim.py (12 models of one type, Zipf(1), Azure lengths, ONE
device holding 2 of them, the load test's "measured" SLO re-shaped to TTFT:TPOT = each ratio),
at rates from below the service rate mu to 8x past it. Each policy runs with its default
SchedulerConfig (what the load test runs) and every point is scored twice: goodput (TTFT and
mean TPOT within the SLO) and strict (every token k by arrival + TTFT + k x TBT). Point
estimates: the mean over the seeds (deterministic: the simulator runs the real policies on a
virtual clock). The claim checked: token >= request - 0.03 at every rate, under both measures.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from load_tests.slo_shapes_sim import _csv, _spec, measured_slo, service_rate


def run_point(spec, policy: str, rate: float, slo) -> dict:
    from cluster.planner.metrics import summarize
    from cluster.planner.simulator import simulate
    from load_tests.sweep import RunSettings, at_rate

    workload = at_rate(spec.workload, rate, RunSettings(max_requests=len(spec.workload)))
    fleet = replace(spec.fleet(policy, 1), slo=slo)
    s = summarize(simulate(workload, spec.market, fleet).records, slo)
    return {"goodput": s["attainment_goodput"], "strict": s["attainment_strict"]}


def main(argv=None) -> int:
    from scheduler.slo import SLO

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratios", default="measured", help="TTFT:TPOT shapes ('measured': slo.py's)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--traces", default="gamma,poisson")
    p.add_argument("--models", type=int, default=12)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--model-type", default="qwen2.5-7b")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--h2d-gbps", type=float, default=2000.0)
    p.add_argument("--rate-factors", default="0.5,1,2,4,8", help="multiples of the service rate mu")
    args = p.parse_args(argv)
    seeds = _csv(args.seeds, int)
    out = {"settings": vars(args), "traces": {}}
    worst = 0.0
    for arrival in _csv(args.traces, str):
        specs = {s: _spec(args, arrival, s) for s in seeds}
        ttft, tbt = measured_slo(specs[seeds[0]])
        mu = service_rate(specs[seeds[0]])
        trace_out = out["traces"][arrival] = {"mu": mu, "shapes": {}}
        for ratio in _csv(args.ratios, str):
            slo = SLO(ttft if ratio == "measured" else float(ratio) * tbt, tbt)
            rows = trace_out["shapes"][ratio] = {"slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "rates": {}}
            for f in _csv(args.rate_factors):
                row = {}
                for policy in ("token", "request"):
                    points = [run_point(specs[s], policy, f * mu, slo) for s in seeds]
                    row[policy] = {m: round(sum(pt[m] for pt in points) / len(points), 4)
                                   for m in ("goodput", "strict")}
                    row[policy]["per_seed"] = points
                gap = {m: round(row["token"][m] - row["request"][m], 4) for m in ("goodput", "strict")}
                row["token_minus_request"] = gap
                worst = min(worst, *gap.values())
                rows["rates"][f"{f}x"] = row
                print(f"{arrival} {ratio} {f}x mu ({f * mu:.3g}/s): goodput {row['token']['goodput']:.3f} vs "
                      f"{row['request']['goodput']:.3f}, strict {row['token']['strict']:.3f} vs "
                      f"{row['request']['strict']:.3f}", file=sys.stderr, flush=True)
    out["worst_token_minus_request"] = worst
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
