"""`tokenmux plan`: how many GPUs a marketplace needs, per policy, from a trace or a synthetic one.

    tokenmux plan --trace ../shared/data/traces/aegaeon-synth/synth-16-0.5-1.0-1.0.csv --gpu H100 \
        --json plan.json --plot plan.png
    tokenmux plan --models 120 --popularity longtail --rate 8 --duration 300 --gpu H100

Arguments -> workload (a trace, or arrivals x popularity x Azure lengths) -> a marketplace
(each model a type of --model-mix, costs fitted from --profiles on --gpu) -> one device
layout (slots x weights + KV, refused with the numbers when it does not fit) -> the
planner's search per policy (cluster/planner/planner.py) -> a table, JSON, a plot.

This module imports only the standard library at the top, so `tokenmux --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cluster.planner.marketplace import DEFAULT_MIX   # stdlib + dataclasses only

    w = p.add_argument_group("workload: a trace, or a synthetic marketplace")
    w.add_argument("--trace", help="trace CSV (Aegaeon, Azure 2023 or BurstGPT)")
    w.add_argument("--start", type=float, default=0.0, help="trace window start, s")
    w.add_argument("--end", type=float, help="trace window end, s")
    w.add_argument("--speedup", type=float, default=1.0, help="replay the trace this many times faster")
    w.add_argument("--max-requests", type=int, help="keep the first N requests")
    w.add_argument("--models", type=int, default=20, help="synthetic: models in the marketplace")
    w.add_argument("--popularity", choices=("longtail", "zipf", "uniform"), default="longtail",
                   help="synthetic: longtail = Aegaeon's 94%% of models get 1.35%% of requests")
    w.add_argument("--zipf-alpha", type=float, default=1.0)
    w.add_argument("--rate", type=float, default=4.0, help="synthetic: total arrivals per second")
    w.add_argument("--duration", type=float, default=300.0, help="synthetic: seconds of arrivals")
    w.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    w.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation")
    w.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("device and layout")
    d.add_argument("--gpu", default="H100", help="H100 | H800 | H20 | A10, or a device.json from `tokenmux profile`")
    d.add_argument("--memory-gb", type=float, help="override the device memory (GiB)")
    d.add_argument("--h2d-gbps", type=float, help="override host -> device bandwidth (GB/s)")
    d.add_argument("--d2d-gbps", type=float, help="override device -> device bandwidth on a node (GB/s)")
    d.add_argument("--net-gbps", type=float, help="override bandwidth across nodes (GB/s)")
    d.add_argument("--gpus-per-node", type=int, help="override devices per node")
    d.add_argument("--model-mix", default=DEFAULT_MIX,
                   help="model types and shares, e.g. qwen2.5-7b:0.6,yi-9b:0.2,llama2-13b:0.2, or a "
                        "profile directory from `tokenmux profile` (default: Aegaeon's mix)")
    d.add_argument("--profiles", help="profiles root (default: ../shared/data/profiles)")
    d.add_argument("--slots", type=int, default=2, help="weight slots per device, each the largest model")
    d.add_argument("--kv-gb", type=float, help="KV pool per device, GiB (default: what is left)")
    d.add_argument("--reserve-frac", type=float, default=0.1, help="memory kept for activations/context")
    d.add_argument("--host-kv-gb", type=float, default=64.0, help="host KV swap space per device, GiB")
    d.add_argument("--slab-mb", type=float, default=64.0, help="KV pool granularity, MiB")
    s = p.add_argument_group("SLO, policies, search")
    s.add_argument("--slo-ttft", type=float, default=10.0, help="TTFT SLO, s (Aegaeon: 10)")
    s.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT/TBT SLO, s (Aegaeon: 0.1)")
    s.add_argument("--policies", type=_csv, default=["token", "request", "dedicated"])
    s.add_argument("--metric", choices=("strict", "goodput", "cumulative"), default="strict")
    s.add_argument("--target", type=float, default=0.9, help="attainment a GPU count must reach")
    s.add_argument("--max-gpus", type=int, help="largest GPU count searched (default: 64, or one more than "
                                                "the models, so dedicated can give each a device)")
    s.add_argument("--gpus", type=int, help="evaluate this GPU count only")
    s.add_argument("--search", choices=("bisect", "scan"), default="bisect")
    s.add_argument("--quota-max", default="auto",
                   help="Q_max of the quota rule, s; auto = Aegaeon's 4 s scaled by the mean switch time")
    s.add_argument("--replan-interval", type=float, default=2.0, help="placement interval, s (0 = plan once)")
    s.add_argument("--split", action="store_true", help="let placement split prefill/decode pools")
    s.add_argument("--max-models-per-worker", type=int, default=32)
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", help="write the results here")
    o.add_argument("--plot", help="write attainment vs GPUs (PNG) here")
    o.add_argument("--no-progress", action="store_true")


def build_spec(args):
    """(PlanSpec, description) from the arguments; ValueError names what is wrong."""
    from dataclasses import replace

    from cluster.planner.devices import DeviceLayout, device_spec
    from cluster.planner.marketplace import PROFILES_DIR, Marketplace, parse_mix
    from cluster.planner.planner import PlanSpec, quota_for_device
    from scheduler.placement import PlacementConfig
    from scheduler.policy import SchedulerConfig
    from scheduler.routing import RoutingConfig
    from scheduler.slo import SLO

    bad = [p for p in args.policies if p not in ("token", "request", "dedicated")]
    if bad or not args.policies:
        raise ValueError(f"--policies takes token,request,dedicated; got {args.policies}")
    workload, names, source = _workload(args)
    if not len(workload):
        raise ValueError("the workload has no requests (check --start/--end/--max-requests)")
    device = device_spec(args.gpu, memory_bytes=_gib(args.memory_gb), h2d_bytes_per_s=_gb(args.h2d_gbps),
                         d2d_bytes_per_s=_gb(args.d2d_gbps), net_bytes_per_s=_gb(args.net_gbps),
                         devices_per_node=args.gpus_per_node)
    market = Marketplace.build(names, parse_mix(args.model_mix), device, args.profiles or PROFILES_DIR)
    layout = DeviceLayout.carve(device, market.largest_weight_bytes(), args.slots,
                                kv_bytes=_gib(args.kv_gb), reserve_frac=args.reserve_frac,
                                host_kv_bytes=int(args.host_kv_gb * GiB), slab_bytes=int(args.slab_mb * MiB))
    too_big = sorted({t.name for t in market.types.values() if t.device_kv_shape.block_bytes > layout.slab_bytes})
    if too_big:
        raise ValueError(f"a KV block of {too_big} does not fit a {args.slab_mb} MiB slab; raise --slab-mb")
    slo = SLO(args.slo_ttft, args.slo_tpot)
    quota = quota_for_device(market, layout) if args.quota_max == "auto" else float(args.quota_max)
    mean_in = sum(r.input_len for r in workload) / len(workload)
    mean_out = sum(r.output_len for r in workload) / len(workload)
    # Requests in flight one replica can hold: its share of the KV pool, for the hungriest type.
    per_replica = max(1.0, min(0.8 * layout.kv_bytes / (t.kv_bytes_per_token * (mean_in + mean_out))
                               for t in market.types.values()))
    span = max(workload.duration_s, 1e-9)
    counts = Counter(r.model for r in workload)
    placement = PlacementConfig(
        request_s=max(1e-3, 0.5 * mean_out * slo.tbt_s),   # tokens at the quota rule's alpha >= 0.5
        scale_out_load=per_replica, scale_in_load=per_replica * 3 / 8, swap_bytes_per_s=device.h2d_bytes_per_s,
        max_models_per_worker=args.max_models_per_worker,
        quota_max_s=quota, **({} if args.split else {"split_load": float("inf"), "merge_load": 1e300}))
    routing = RoutingConfig(swap_bytes_per_s=device.h2d_bytes_per_s, default_weight_bytes=market.largest_weight_bytes())
    spec = PlanSpec(workload, market, layout, slo, {m: n / span for m, n in counts.items()},
                    replace(SchedulerConfig(), quota_max_s=quota), placement, routing,
                    args.replan_interval, args.metric, args.target)
    about = {"source": source, "num_requests": len(workload), "duration_s": workload.duration_s,
             "num_models": len(names), "models_with_requests": len(counts),
             "mean_input_tokens": mean_in, "mean_output_tokens": mean_out,
             "type_counts": market.type_counts(), "model_mix": args.model_mix,
             "model_types": {t.name: t.to_dict() for t in {t.name: t for t in market.types.values()}.values()}}
    return spec, about


def run(args) -> int:
    from cluster.planner.planner import savings, search, table

    spec, about = build_spec(args)
    progress = None if args.no_progress else _progress_bar(len(args.policies))
    plans = {}
    # Dedicated's answer is at least one device per model; a 120-model marketplace needs the search
    # to reach 121 (its stability check) or dedicated answers null and savings cannot be priced.
    max_gpus = args.max_gpus if args.max_gpus is not None else max(64, len(spec.market.types) + 1)
    try:
        for policy in args.policies:
            plans[policy] = search(spec, policy, max_gpus, args.search, only=args.gpus,
                                   on_point=progress.point if progress else None)
    finally:
        if progress:
            progress.close()
    print(table(plans, args.metric, args.target))
    for name in spec.market.scaled_types():
        t = about["model_types"][name]
        tp = f", tensor_parallel {t['tensor_parallel']} (its GPUs count every device of its group)" \
            if t.get("tensor_parallel", 1) > 1 else ""
        print(f"{name}: step costs scaled from {t['derived_from']}, not measured{tp}")
    out = {"policies": {p: plan.to_dict() for p, plan in plans.items()},
           "savings_vs_dedicated": savings(plans), "metric": args.metric, "target": args.target,
           "slo": {"ttft_s": spec.slo.ttft_s, "tbt_s": spec.slo.tbt_s}, "workload": about,
           "layout": spec.layout.to_dict(), "quota_max_s": spec.scheduler.quota_max_s,
           "search": args.search, "max_gpus": max_gpus, "replan_interval_s": spec.replan_interval_s,
           "split": bool(args.split)}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        from cluster.planner.planner import plot

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(plans, args.metric, args.target, args.plot,
             f"{about['source']}: {about['num_models']} models, {spec.layout.device.name}")
    return 0


def _workload(args):
    from cluster.planner import workloads as w
    from cluster.planner.traces import lengths_from_azure, read_trace

    if args.models < 1:
        raise ValueError(f"--models must be >= 1, got {args.models}")
    names = [f"model-{i:03d}" for i in range(args.models)]
    popularity = {"longtail": w.LongTail, "uniform": w.Uniform,
                  "zipf": lambda: w.Zipf(args.zipf_alpha)}[args.popularity]()
    if args.trace:
        # A trace without a model column (Azure 2023) draws each request's model from
        # --popularity over --models names; the others keep their own models.
        assign = _has_no_model_column(args.trace)
        workload = read_trace(args.trace, deployed=names if assign else None,
                              popularity=popularity if assign and args.models > 1 else None, seed=args.seed,
                              speedup=args.speedup, start_s=args.start, end_s=args.end,
                              max_requests=args.max_requests)
        return workload, (names if assign else workload.models), Path(args.trace).name   # most requested first
    if not args.rate > 0 or not args.duration > 0:
        raise ValueError("--rate and --duration must be > 0")
    arrivals = w.Poisson(args.rate) if args.arrival == "poisson" else w.Gamma(args.rate, args.cv)
    from cluster.planner.marketplace import AZURE_CONV

    lengths = (lengths_from_azure(AZURE_CONV, max_input=4000, max_output=2000)
               if AZURE_CONV.is_file() else w.LogNormalLengths(input_median=700, output_median=250))
    workload = w.generate(arrivals, popularity, names, lengths, seed=args.seed, duration_s=args.duration)
    return workload, names, f"synthetic {args.popularity} x{args.models} at {args.rate:g} req/s"


def _has_no_model_column(path: str) -> bool:
    import csv

    from cluster.planner.traces import detect_schema

    if not Path(path).is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
    if header is None:
        raise ValueError(f"trace {path} is empty")
    return detect_schema(header) == "azure"   # the one schema without a model column


class _progress_bar:
    """One tqdm bar over simulated points; its text says which policy and count ran last."""

    def __init__(self, num_policies: int):
        from tqdm import tqdm

        self.bar = tqdm(total=None, unit="sim", file=sys.stderr, desc="plan")

    def point(self, policy: str, point) -> None:
        self.bar.set_postfix_str(f"{policy} x{point.gpus}: {point.attainment:.3f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _gib(x: float | None) -> int | None:
    return None if x is None else int(x * GiB)


def _gb(x: float | None) -> float | None:
    return None if x is None else x * 1e9
