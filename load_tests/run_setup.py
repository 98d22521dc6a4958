"""What a load test runs on, built from its arguments: the served models (zoo names, copies of
one checkpoint, or `shape:NAME` random-weight checkpoints), the engine config of every worker,
the workload, the SLO measured on this machine, and the scheduler overrides of the ablations.

Shared by `tokenmux loadtest` (runner.py), the experiment (experiment.py) and the published
run (published.py), which is why it is a module of its own: each of them needs these, and
runner.py needs both of them. Standard library only at the top.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from cluster.planner.marketplace import AZURE_CONV, DATA_DIR  # re-exported; stdlib + scheduler only

logger = logging.getLogger(__name__)

MiB = 1 << 20
QUIET_SPREAD = 1.5   # the SLO's decode rounds differing more than this: a busy machine (logged)
SLO_ATTEMPTS = 3


def _checkpoint(name_or_dir: str) -> str:
    if Path(name_or_dir, "config.json").is_file():
        return str(Path(name_or_dir))
    if name_or_dir.startswith("shape:"):   # random weights of a real shape (load_tests/bench/shapes.py)
        return str(_shape_checkpoint(name_or_dir.removeprefix("shape:")))
    from actors.zoo.zoo import ensure_model

    return str(ensure_model(name_or_dir))


def _shape_checkpoint(name: str) -> Path:
    """A random-weight checkpoint of a real shape, built once into the shared cache
    (TOKENMUX_SHAPE_DIR, default ~/.cache/tokenmux/shapes) and reused after."""
    import json

    from load_tests.bench.shapes import build_shape, parse_shapes

    parse_shapes(name)
    parent = Path(os.environ.get("TOKENMUX_SHAPE_DIR") or Path.home() / ".cache" / "tokenmux" / "shapes")
    parent.mkdir(parents=True, exist_ok=True)
    for d in sorted(parent.glob(f"tokenmux-shape-{name}-*")):
        marker = d / "tokenmux-shape.json"
        if marker.is_file() and json.loads(marker.read_text()).get("shape") == name:
            return d
    import torch

    return build_shape(name, parent, device="cuda" if torch.cuda.is_available() else "cpu")


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
    # detokenize=False: the driver reads token ids, as the Serve peer sends them (the ingress
    # makes text in serving, off the worker)
    config = {"budget_bytes": budget, "kv_bytes": kv, "num_slots": args.slots,
              "slab_bytes": 4 * MiB, "host_kv_bytes": 128 * MiB, "detokenize": False}
    if getattr(args, "device_slowdown", 1.0) != 1.0:   # a paced virtual device (actors/device_pace.py)
        config["device_slowdown"] = float(args.device_slowdown)
    for key in ("device", "dtype"):   # a GPU run (load_tests/published.py --gpu); CPU by default
        if getattr(args, key, None):
            config[key] = getattr(args, key)
    return config


def make_workload(args, names: list[str], rate: float, num_requests: int | None, duration_s: float | None = None):
    """A synthetic workload at `rate`: num_requests requests, or every arrival in duration_s seconds."""
    from cluster.planner import workloads as w

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
        from cluster.planner.traces import lengths_from_azure

        lengths = lengths_from_azure(AZURE_CONV, **limits)
    elif args.lengths == "lognormal":
        lengths = w.LogNormalLengths(**limits)
    else:   # a trace file: its (input, output) pairs, resampled
        if not Path(args.lengths).is_file():
            raise ValueError(f"--lengths {args.lengths}: not azure, lognormal or a trace file")
        from cluster.planner.traces import lengths_from_trace

        lengths = lengths_from_trace(args.lengths, **limits)
    return w.generate(arrivals, popularity, names, lengths, seed=args.seed, num_requests=num_requests,
                      duration_s=duration_s)


def measured_slo(models: dict[str, str], args, threads: int) -> dict:
    from load_tests.slo import (DEFAULT_TBT_FACTOR, DEFAULT_TTFT_FACTOR, default_slo, measure_step_times,
                                wait_for_quiet)
    from actors.model_spec import ModelSpec

    largest = max(set(models.values()), key=lambda p: ModelSpec.from_dir(p).weight_bytes)
    import ray

    # Measured in a Ray worker process with one device's share of the cores, as the
    # contenders' workers run (same scheduling priority, same share of a busy machine), once
    # the machine is quiet, SLO_ATTEMPTS times: background work only adds time, so the fastest
    # measurement (by its median decode step) is kept; all of them are reported.
    busy = wait_for_quiet()
    remote = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(measure_step_times)
    attempts = [ray.get(remote.remote(largest, prompt_len=min(128, args.max_input), batch_size=4,
                                      num_decode_steps=32, num_threads=threads,
                                      device=getattr(args, "device", None) or "cpu",
                                      dtype=getattr(args, "dtype", None),
                                      device_slowdown=getattr(args, "device_slowdown", 1.0)))
                for _ in range(SLO_ATTEMPTS)]
    times = min(attempts, key=lambda t: t.decode_s)
    spread = _spread(times.decode_rounds_s)
    if spread > QUIET_SPREAD:
        logger.warning("the SLO's decode step varied %.2fx between rounds (%s s): the machine is not quiet",
                       spread, ", ".join(f"{r:.4g}" for r in times.decode_rounds_s))
    slo = default_slo(times)
    return {"ttft_s": args.slo_ttft or slo.ttft_s, "tbt_s": args.slo_tbt or slo.tbt_s,
            "decode_spread": spread, "busy_cores_before": busy,
            "attempts_decode_s": [t.decode_s for t in attempts], "derived_from": times.to_dict(),
            "tbt_factor": DEFAULT_TBT_FACTOR, "ttft_factor": DEFAULT_TTFT_FACTOR,
            "rule": "TBT = tbt_factor x decode_s; TTFT = ttft_factor x (prefill_s + switch_s), "
                    "medians measured in a Ray worker with one device's share of the cores once the "
                    f"machine is quiet, the fastest of {SLO_ATTEMPTS} measurements"}


def _spread(rounds) -> float:
    """max / min of a measurement's per-round decode steps (1.0: every round alike)."""
    return max(rounds) / min(rounds) if rounds and min(rounds) > 0 else 1.0


def scheduler_overrides(args) -> dict:
    """SchedulerConfig fields the token contender gets from the ablation flags."""
    out = {}
    if getattr(args, "no_quota_cap", False):
        out["quota_switch_factor"] = None
    if getattr(args, "no_overload_control", False):
        out["overload_control"] = False
    if getattr(args, "no_ttft_slack", False):
        out["ttft_slack"] = False
    return out


def run_settings(args):
    """How each point is driven: sustained (load_tests/sustained.py) unless --burst."""
    from load_tests.sustained import SustainSpec
    from load_tests.sweep import RunSettings

    sustain = None if args.burst else SustainSpec(args.sustain_s, args.sustain_requests, args.warmup_s)
    return RunSettings(max_requests=args.max_requests, duration_s=args.duration,
                       request_timeout_s=args.request_timeout, seed=args.seed, progress=args.progress,
                       idle_skip_s=args.idle_skip, sustain=sustain,
                       **({} if args.settle is None else {"settle_s": args.settle}))
