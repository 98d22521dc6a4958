"""`tokenmux bench colocate`: N agents on one device, time-sliced across processes or multiplexed by tokenmux.

Running several LLM agents on one GPU by time-slicing costs each agent up to 40% of its
speed (two agents) and up to 3x overall (memory-bandwidth and cache contention), which is
why people fall back to MIG or dedicated GPUs. tokenmux's answer is one engine that
multiplexes the agents' models itself. For each N in --agents, each agent a closed-loop
multi-turn session on its own model (load_tests/bench/agents.py):

  alone        one agent, one engine process: the reference (measured again before each N)
  time-sliced  N engine processes, one model each, all on the same device (on a CPU the
               same cores, each process using all of them as it would a whole GPU; on a
               GPU the driver's default time-slicing between processes)
  tokenmux     one engine process holding the N models, switching between decode steps

Every arrangement runs in fresh child processes that load, warm up, then start together.
Engines get the same budget per model (one weight slot and KV for one conversation), so
tokenmux's one engine holds what the N separate engines hold between them.

Figures per arrangement: per-agent tokens/s (output tokens / time waiting for them)
relative to alone, TTFT and TBT p50/p99 over all tokens, TBT jitter (coefficient of
variation of each agent's gaps, mean over agents), memory held (sum over its processes:
RSS on a CPU, NVML's per-process device memory on a GPU), aggregate tokens/s (all output
tokens / first request to last token). Each arrangement runs --repeats times (order of the
pair flipped every repeat), seeds fixed; the JSON keeps every repeat, the medians, and the
range of each ratio over the repeats. At N = 4 the headline ratios are tokenmux /
time-sliced: `colocate_tps_ratio` (aggregate tokens/s), `colocate_tbt_p99_ratio` and
`colocate_memory_ratio`.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ARRANGEMENTS = ("alone", "time-sliced", "tokenmux")
START_TIMEOUT_S = 600.0


def _child(names: list[str], path: str, specs: list[dict], options: dict, ready, go, out) -> None:
    """One engine process: load and warm up its models, wait for `go`, run its agents, report."""
    try:
        import torch

        from load_tests.bench.agents import Agent, AgentSpec, run_agents
        from load_tests.bench.common import bench_host_cache, engine_for, greedy_requests, run_to_completion

        if options.get("threads"):
            torch.set_num_threads(options["threads"])
        device = torch.device(options["device"])
        agents = [Agent(AgentSpec(**s)) for s in specs]
        tokens = max(a.spec.max_context for a in agents)
        with bench_host_cache() as cache:
            engine = engine_for({n: Path(path) for n in names}, num_slots=options["slots"] or len(names),
                                tokens_per_model=tokens + 16, device=device, dtype=options["dtype"], host_cache=cache)
            if options.get("scheduler"):   # tokenmux's scheduler settings other than the defaults
                import dataclasses

                engine.policy.config = dataclasses.replace(engine.policy.config, **options["scheduler"])
            # warm up at the first turn's prompt length (first calls of a shape are slow on a CPU)
            first = [[9] * (agents[0].spec.system_tokens + agents[0].spec.user_tokens)]
            run_to_completion(engine, [r for n in names for r in greedy_requests(n, first, 4, "warm")])
            ready.put(os.getpid())
            go.wait(START_TIMEOUT_S)
            run_agents(engine, agents)
            out.put({"pid": os.getpid(), "agents": [a.summary() for a in agents],
                     "memory_bytes": _memory_held(device), "swaps": engine.slots.stats()["num_swaps"]})
    except BaseException as exc:   # the parent reports it; a child never hangs the benchmark
        ready.put(os.getpid())
        out.put({"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})


def _memory_held(device) -> int:
    """This process's memory: device memory on a GPU (NVML, else torch's reserve), RSS on a CPU."""
    import psutil

    if device.type != "cuda":
        return int(psutil.Process().memory_info().rss)
    import torch

    try:
        import pynvml

        from actors.device_telemetry import cuda_uuid

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(cuda_uuid(str(device)))
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:   # a container's pid namespace may hide it
                return int(p.usedGpuMemory)
    except Exception:
        pass
    return int(torch.cuda.memory_reserved(device))


def run_arrangement(arrangement: str, n: int, path: Path, args) -> dict:
    """Start the arrangement's processes, let them run together, gather their agents."""
    names = [f"agent{i}" for i in range(n)]
    specs = [dict(model=name, seed=1000 * args.seed + i, turns=args.turns, new_tokens=args.new_tokens,
                  user_tokens=args.user_tokens, think_s=args.think_s) for i, name in enumerate(names)]
    groups = [(names, specs)] if arrangement == "tokenmux" else [([nm], [sp]) for nm, sp in zip(names, specs)]
    options = {"device": args.device, "dtype": args.dtype, "threads": args.threads,
               "slots": args.tokenmux_slots if arrangement == "tokenmux" else 1,
               "scheduler": _scheduler_overrides(args) if arrangement == "tokenmux" else {}}
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_child, args=(g_names, str(path), g_specs, options, ready, go, out), daemon=True)
             for g_names, g_specs in groups]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=START_TIMEOUT_S)
    go.set()
    results = [out.get(timeout=START_TIMEOUT_S) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{arrangement} with {n} agents failed: {errors}")
    return _figures([a for r in results for a in r["agents"]], sum(r["memory_bytes"] for r in results),
                    sum(r["swaps"] for r in results), len(procs))


def _scheduler_overrides(args) -> dict:
    """SchedulerConfig fields the command line sets for tokenmux's engine (the ablations)."""
    overrides = {}
    if args.quota_steps:   # decode steps per turn when every model is resident
        overrides["min_quota_steps"] = args.quota_steps
    if args.no_chunked_prefill:
        overrides["chunked_prefill"] = False
    if args.smooth:
        overrides["smooth_streams"] = True
    return overrides


def _percentile(values: list[float], p: float) -> float:
    import numpy as np

    return float(np.percentile(values, p)) if values else float("nan")


def _figures(agents: list[dict], memory: int, swaps: int, processes: int) -> dict:
    tbt = [g for a in agents for g in a["tbt_s"]]
    ttft = [t for a in agents for t in a["ttft_s"]]
    cv = [statistics.pstdev(a["tbt_s"]) / statistics.mean(a["tbt_s"]) for a in agents if len(a["tbt_s"]) > 1]
    span = max(a["end"] for a in agents) - min(a["start"] for a in agents)
    return {"per_agent_tps": [a["tokens_per_s"] for a in agents], "aggregate_tps": sum(a["tokens"] for a in agents) / span,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tbt_p50_s": _percentile(tbt, 50), "tbt_p99_s": _percentile(tbt, 99),
            "tbt_cv": statistics.mean(cv) if cv else float("nan"), "memory_bytes": memory, "processes": processes,
            "swaps": swaps, "num_tokens": sum(a["tokens"] for a in agents)}


def run(args: argparse.Namespace) -> int:
    from actors.zoo import zoo

    counts = _counts(args.agents)
    for name in ("turns", "new_tokens", "user_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.think_s < 0 or any(v is not None and v < 1 for v in (args.tokenmux_slots, args.quota_steps)):
        raise ValueError("--think-s must be >= 0, --tokenmux-slots and --quota-steps >= 1")
    if args.shape:   # a random-weight checkpoint of a real model shape (the GPU run: 7B-shaped agents)
        import shutil

        from load_tests.bench.shapes import build_shape, scratch_dir, shape_bytes

        path = build_shape(args.shape, scratch_dir(shape_bytes(args.shape)), args.device)
        args.model = args.shape
        try:
            return _run(args, counts, path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    path = zoo.ensure_model(args.model) if args.model in zoo.ZOO else Path(args.model)
    if not path.is_dir():
        raise ValueError(f"--model: {args.model!r} is neither a zoo model nor a checkpoint directory")
    return _run(args, counts, path)


def _run(args: argparse.Namespace, counts: list[int], path: Path) -> int:
    results = {"benchmark": "colocate", "command": " ".join(sys.argv), "model": args.model, "device": args.device,
               "agents": counts, "options": {k: v for k, v in vars(args).items() if k not in ("run", "func")},
               "runs": {}, "load_average_start": list(os.getloadavg())}
    # With one agent every arrangement is "alone". For N > 1 the reference is re-measured right
    # before each (time-sliced, tokenmux) pair, so a slow drift of the machine's load hits all three.
    for repeat in range(args.repeats):
        for n in counts:
            logger.info("repeat %d: alone, then %d agents", repeat, n)
            alone = run_arrangement("alone", 1, path, args)
            alone["per_agent_tps_vs_alone"] = 1.0
            results["runs"].setdefault("1", {}).setdefault("alone", []).append(alone)
            if n == 1:
                continue
            for arrangement in (("time-sliced", "tokenmux") if repeat % 2 == 0 else ("tokenmux", "time-sliced")):
                fig = run_arrangement(arrangement, n, path, args)
                fig["per_agent_tps_vs_alone"] = statistics.mean(fig["per_agent_tps"]) / alone["per_agent_tps"][0]
                results["runs"].setdefault(str(n), {}).setdefault(arrangement, []).append(fig)
            _save(results, args.json)
    results["summary"] = summarise(results["runs"])
    if "4" in results["summary"]:
        s = results["summary"]["4"]
        results.update(colocate_tps_ratio=s["tps_ratio"], colocate_tbt_p99_ratio=s["tbt_p99_ratio"],
                       colocate_memory_ratio=s["memory_ratio"])
    results["load_average_end"] = list(os.getloadavg())
    _save(results, args.json)
    if args.plot:
        plot(results, args.plot)
    print(format_table(results))
    return 0


KEYS = ("per_agent_tps_vs_alone", "aggregate_tps", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tbt_cv",
        "memory_bytes")


def summarise(runs: dict) -> dict:
    """Medians over repeats per (N, arrangement), and tokenmux / time-sliced ratios per repeat and their median."""
    out = {}
    for n, by_arr in runs.items():
        row = {arr: {k: statistics.median(r[k] for r in reps) for k in KEYS if k in reps[0]}
               for arr, reps in by_arr.items()}
        if "tokenmux" in by_arr and "time-sliced" in by_arr:
            pairs = list(zip(by_arr["tokenmux"], by_arr["time-sliced"]))
            for name, key in (("tps_ratio", "aggregate_tps"), ("tbt_p99_ratio", "tbt_p99_s"),
                              ("memory_ratio", "memory_bytes")):
                ratios = [t[key] / s[key] for t, s in pairs]
                row[name], row[name + "_range"] = statistics.median(ratios), [min(ratios), max(ratios)]
        out[n] = row
    return out


def format_table(results: dict) -> str:
    lines = [f"colocate: {results['model']} on {results['device']}, agents {results['agents']}, "
             f"{results['options']['repeats']} repeat(s), medians",
             f"{'N':>2} {'arrangement':<12} {'tps/alone':>9} {'agg tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TBT p50':>8} {'TBT p99':>8} {'TBT CV':>6} {'memory':>9}"]
    for n, row in sorted(results["summary"].items(), key=lambda kv: int(kv[0])):
        for arr in ARRANGEMENTS:
            if arr in row:
                f = row[arr]
                lines.append(f"{n:>2} {arr:<12} {f.get('per_agent_tps_vs_alone', 1.0):>9.2f} {f['aggregate_tps']:>9.1f} "
                             f"{f['ttft_p50_s'] * 1e3:>7.0f}ms {f['ttft_p99_s'] * 1e3:>7.0f}ms "
                             f"{f['tbt_p50_s'] * 1e3:>6.1f}ms {f['tbt_p99_s'] * 1e3:>6.1f}ms {f['tbt_cv']:>6.2f} "
                             f"{f['memory_bytes'] / 2**20:>7.0f}MB")
        if "tps_ratio" in row:
            lines.append(f"   tokenmux / time-sliced: aggregate tok/s {row['tps_ratio']:.2f}, TBT p99 "
                         f"{row['tbt_p99_ratio']:.2f}, memory {row['memory_ratio']:.2f}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [n for n in results["agents"] if str(n) in results["summary"]]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = (("per_agent_tps_vs_alone", "per-agent tokens/s / alone", 1), ("aggregate_tps", "aggregate tokens/s", 1),
              ("tbt_p99_s", "TBT p99 (ms)", 1e3), ("memory_bytes", "memory held (MiB)", 2**-20))
    for ax, (key, label, scale) in zip(axes, panels):
        for arr, style in (("time-sliced", "o--"), ("tokenmux", "s-")):
            row = results["summary"]
            xs = [n for n in counts if arr in row[str(n)] or n == 1]
            ys = [row[str(n)]["alone" if n == 1 else arr][key] * scale for n in xs]
            ax.plot(xs, ys, style, label=arr)
        ax.set_xlabel("agents")
        ax.set_title(label)
        ax.set_xticks(counts)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{results['model']} agents on one {results['device']} device: time-slicing vs tokenmux")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--agents must be comma-separated integers, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--agents needs counts >= 1, got {text!r}")
    return counts


def _save(results: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1, default=str) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", default="1,2,4,8", help="agent counts (default 1,2,4,8)")
    parser.add_argument("--model", default="llama-10m", help="checkpoint every agent's model is made from "
                        "(one copy per agent; default the zoo's llama-10m)")
    parser.add_argument("--shape", help="instead of --model: a random-weight checkpoint of this real shape "
                        "(e.g. qwen2.5-7b; see load_tests/bench/shapes.py), built for the run and removed after")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the checkpoint's")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: all cores, as a process "
                        "that owns the device would)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per turn")
    parser.add_argument("--user-tokens", type=int, default=24, help="user tokens added per turn")
    parser.add_argument("--think-s", type=float, default=0.1, help="think time between turns, seconds")
    parser.add_argument("--tokenmux-slots", type=int, help="weight slots of tokenmux's engine (default: one per "
                        "agent, the memory the time-sliced engines hold together)")
    parser.add_argument("--quota-steps", type=int, help="tokenmux's decode steps per turn when every model is "
                        "resident (SchedulerConfig.min_quota_steps; default: the scheduler's, 4)")
    parser.add_argument("--no-chunked-prefill", action="store_true", help="tokenmux prefills whole prompts "
                        "(SchedulerConfig.chunked_prefill=False; the ablation)")
    parser.add_argument("--smooth", action="store_true", help="tokenmux's engine smooths its streams "
                        "(SchedulerConfig.smooth_streams: turns in slices, prefill spread between them)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arrangement (medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="write the plot here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.bench.colocate", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except ValueError as e:
        print(f"colocate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
