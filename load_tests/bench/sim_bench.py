"""`tokenmux bench sim`: how long the fleet simulator takes for one trace on one fleet size.

    tokenmux bench sim --json sim.json     # Aegaeon's synth-20-0.1-1.0-2.0 on 16 H100s

Builds the planner's spec for the trace once (profiles fitted once: `fits` counts them),
then simulates it `--repeats` times per policy on `--gpus` devices and reports the median
wall time (floor: <= 5 s for the 20-model, 16-GPU trace), every sample, the simulated
steps per second and the attainment (the runs are deterministic: the same every time).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

FLOOR_S = 5.0


def add_arguments(p) -> None:
    from cluster.planner.marketplace import DATA_DIR

    p.add_argument("--trace", default=str(DATA_DIR / "traces" / "aegaeon-synth" / "synth-20-0.1-1.0-2.0.csv"))
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--gpu", default="H100")
    p.add_argument("--policies", default="token,request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path", help="write the results here")


def run(args) -> int:
    from cluster.planner.cost_model import num_fits
    from cluster.planner.metrics import summarize
    from cluster.planner.plan_cli import add_arguments as add_plan_arguments, build_spec
    from cluster.planner.simulator import simulate

    if args.repeats < 1 or args.gpus < 1:
        raise ValueError("--repeats and --gpus must be >= 1")
    started = time.perf_counter()
    fits_before = num_fits()
    plan_parser = argparse.ArgumentParser(prog="tokenmux plan")
    add_plan_arguments(plan_parser)
    plan_args = plan_parser.parse_args(["--trace", args.trace, "--gpu", args.gpu])
    spec, about = build_spec(plan_args)
    setup_s = time.perf_counter() - started
    out = {"trace": Path(args.trace).name, "gpus": args.gpus, "device": spec.layout.device.name,
           "num_models": about["num_models"], "num_requests": about["num_requests"],
           "profile_fits": num_fits() - fits_before, "setup_s": setup_s, "repeats": args.repeats,
           "measure": "wall seconds of one simulate() call, median of the repeats", "floor_s": FLOOR_S,
           "policies": {}, "machine": {"cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
                                       "python": platform.python_version(), "platform": platform.platform()}}
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        walls, result = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = simulate(spec.workload, spec.market, spec.fleet(policy, args.gpus), spec.demand)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        summary = summarize(result.records, spec.slo)
        out["policies"][policy] = {
            "wall_s": wall, "wall_s_samples": walls, "num_steps": result.stats["num_steps"],
            "steps_per_s": result.stats["num_steps"] / wall, "attainment_strict": summary["attainment_strict"],
            "meets_floor": wall <= FLOOR_S}
        print(f"{policy}: {wall:.2f} s ({result.stats['num_steps']} steps, "
              f"{result.stats['num_steps'] / wall:,.0f} steps/s)", file=sys.stderr)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text + "\n")
    return 0
