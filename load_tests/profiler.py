"""`tokenmux profile`: a model's step times on this machine, in the profile format `plan` reads.

    tokenmux profile --model llama-tiny-a --out profiles/llama-tiny-a/cpu --threads 2

For each input length N and batch size B it runs B requests of N prompt tokens through one
Engine in this process (torch threads = one worker's share of the cores) and writes
`iNbB.json` with Aegaeon's keys: `avg_prefill_latency` (one prefill step of the B prompts)
and `avg_decode_latency` (one decode step of the B requests), their samples and
percentiles. Step times are the engine's own timeline (schedule -> run -> update -> emit),
as a DeviceWorker lives them. Beside them:

    model.json   the model type: weight bytes, KV shape, context length
    device.json  this machine as a device for `tokenmux plan --gpu`: memory, and the
                 host -> slot copy rate of this model's swap-in (what a switch costs here)

A model type for `--model-mix` is then the directory itself.

This module imports only the standard library at the top, so `tokenmux --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MiB = 1 << 20
PERCENTILES = (10, 25, 50, 75, 90)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo name or checkpoint directory")
    p.add_argument("--out", required=True, help="directory for iNbB.json, model.json, device.json")
    p.add_argument("--name", help="model type name in model.json (default: the checkpoint's name)")
    p.add_argument("--inputs", type=_ints, default=[16, 32, 64, 128, 256], help="prompt lengths N")
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8], help="batch sizes B (<= 8: one prefill group)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per point")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (one worker's share of the cores)")
    p.add_argument("--device-slowdown", type=float, default=1.0, help="profile a paced virtual device this many "
                   "times slower than its CPU thread (actors/device_pace.py), as `loadtest --device-slowdown`")


def profile(model_dir: str, out: str | Path, *, name: str | None = None, inputs=(16, 32, 64, 128, 256),
            batches=(1, 2, 4, 8), decode_steps: int = 8, repeats: int = 3, threads: int = 1,
            device_slowdown: float = 1.0) -> Path:
    import torch

    from actors.engine import Engine, EngineConfig
    from actors.model_spec import ModelSpec
    from actors.worker_reports import StepRecord
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    for label, values in (("inputs", inputs), ("batches", batches)):
        if not values or any(v < 1 for v in values):
            raise ValueError(f"--{label} must be positive integers, got {list(values)}")
    if max(batches) > 8:
        raise ValueError("--batches above 8 would prefill in more than one step (groups of 8)")
    if decode_steps < 1 or repeats < 1 or threads < 1:
        raise ValueError("--decode-steps, --repeats and --threads must be >= 1")
    spec = ModelSpec.from_dir(model_dir)
    too_long = [n for n in inputs if n + decode_steps + 1 > spec.max_position_embeddings]
    if too_long:
        raise ValueError(f"inputs {too_long} + {decode_steps + 1} tokens exceed the model's context "
                         f"({spec.max_position_embeddings})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kv_bytes = max(32 * MiB, 2 * max(batches) * (max(inputs) + decode_steps + 16) * spec.kv_shape.block_bytes // 16)
    kv_bytes = -(-kv_bytes // (4 * MiB)) * 4 * MiB
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = Engine(EngineConfig(budget_bytes=kv_bytes + spec.weight_bytes + 8 * MiB, kv_bytes=kv_bytes,
                                     num_slots=1, slab_bytes=4 * MiB, host_kv_bytes=0,
                                     detokenize=False,    # as a DeviceWorker runs (text at the ingress)
                                     device_slowdown=device_slowdown))
        engine.register_model("a", model_dir)
        engine.register_model("b", model_dir)
        counter = [0]

        def run(n: int, b: int, max_tokens: int) -> list[StepRecord]:
            engine.timeline.clear()
            for _ in range(b):
                k = counter[0]
                counter[0] += 1
                prompt = [(k * 7 + i) % (spec.vocab_size - 10) + 5 for i in range(n)]
                engine.add_request(GenerateRequest(f"p{k}", "a", prompt,
                                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            while engine.has_unfinished():
                engine.step()
            return list(engine.timeline)

        run(max(inputs), max(batches), 2)   # warm-up: first touches of weights and pool
        for n in inputs:
            for b in batches:
                prefills, decodes = [], []
                for _ in range(repeats):
                    steps = run(n, b, decode_steps + 1)
                    prefills += [s.seconds for s in steps if s.is_prefill]
                    decodes.append(statistics.median(s.seconds for s in steps if not s.is_prefill))
                (out / f"i{n}b{b}.json").write_text(json.dumps(_entry(prefills, decodes), indent=2) + "\n")
        switches = []
        for i in range(2 * repeats + 1):
            t0 = time.perf_counter()
            engine.make_resident("ab"[i % 2])
            switches.append(time.perf_counter() - t0)
        switch_s = statistics.median(switches[1:])
    finally:
        torch.set_num_threads(old_threads)
    s = spec.kv_shape
    (out / "model.json").write_text(json.dumps({
        "name": name or spec.name, "weight_bytes": spec.weight_bytes,
        "kv_shape": [s.num_layers, s.num_kv_heads, s.head_dim, s.dtype_bytes],
        "max_context": spec.max_position_embeddings, "checkpoint": str(model_dir), "threads": threads,
        "device_slowdown": device_slowdown,
    }, indent=2) + "\n")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    copy_rate = spec.weight_bytes / max(switch_s, 1e-9)
    (out / "device.json").write_text(json.dumps({
        "name": f"cpu-{platform.node() or 'host'}", "memory_bytes": memory, "h2d_bytes_per_s": copy_rate,
        "d2d_bytes_per_s": copy_rate, "net_bytes_per_s": copy_rate, "devices_per_node": 1,
    }, indent=2) + "\n")
    logger.info("profiled %s into %s (switch %.4f s)", model_dir, out, switch_s)
    return out


def _entry(prefills: list[float], decodes: list[float]) -> dict:
    return {"avg_prefill_latency": statistics.fmean(prefills), "prefill_latencies": prefills,
            "prefill_percentiles": _percentiles(prefills),
            "avg_decode_latency": statistics.fmean(decodes), "decode_latencies": decodes,
            "decode_percentiles": _percentiles(decodes)}


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {str(p): xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] for p in PERCENTILES}


def run(args) -> int:
    from load_tests.run_setup import _checkpoint   # zoo name or directory -> directory

    path = profile(_checkpoint(args.model), args.out, name=args.name, inputs=args.inputs, batches=args.batches,
                   decode_steps=args.decode_steps, repeats=args.repeats, threads=args.threads,
                   device_slowdown=args.device_slowdown)
    print(path)
    return 0
