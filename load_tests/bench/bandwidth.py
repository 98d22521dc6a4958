"""Decode against the memory-bandwidth limit (`decode_vs_bw_limit`), for a GPU run.

At batch 1 a decode step must read every weight once and the sequence's KV so far, and
does little arithmetic per byte, so no engine can step faster than

    limit = (weight bytes read + KV bytes read) / memory bandwidth

The bandwidth is measured here, not taken from a datasheet: the median of device-to-
device copies of a 1 GiB buffer (each reads and writes it: 2 GiB of traffic). A step
reads all weights but the embedding table, of which only its token's row (the lm_head
reads the table when embeddings are tied), and per layer the K and V of every cached
position. Step times are the engine's own decode turns (`Engine.timeline`) of one
greedy request; `decode_vs_bw_limit` = median step / limit (1.0 would be perfect).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion, sync


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second moved by `dst.copy_(src)` on `device` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def measure_bw_limit(path: Path, *, device: torch.device, host_cache, name: str, kernels: str,
                     prompt_tokens: int = 16, new_tokens: int = 64) -> dict:
    from actors.layer_kernels import EMBED

    prompts = make_prompts(1, prompt_tokens, seed=3)
    engine = engine_for({name: path}, num_slots=2, tokens_per_model=len(prompts[0]) + new_tokens,
                        device=device, dtype=None, host_cache=host_cache, kernels=kernels)
    run_to_completion(engine, greedy_requests(name, prompts, 8, "warm"))   # graphs captured, weights resident
    first = len(engine.timeline)
    run_to_completion(engine, greedy_requests(name, prompts, new_tokens, "bw"))
    steps = [s.seconds for s in list(engine.timeline)[first:] if not s.is_prefill]
    m = engine.models[name]
    spec, layout = m.spec, m.layout
    embed = next(e for e in layout.entries if e.name == EMBED)
    weight_read = layout.total_bytes - (0 if spec.tie_word_embeddings else embed.nbytes - embed.nbytes // spec.vocab_size)
    kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * m.dtype.itemsize
    mean_context = len(prompts[0]) + new_tokens / 2
    bandwidth = copy_bandwidth(device)
    limit = (weight_read + kv_per_token * mean_context) / bandwidth
    step = statistics.median(steps)
    graphs = getattr(m.runner, "graphs", None)
    parts = step_parts(engine, name, len(prompts[0]) + new_tokens // 2)
    kernels = {}
    if device.type == "cuda":
        try:
            kernels = kernel_profile(engine, name, len(prompts[0]) + new_tokens // 2)
        except Exception as exc:   # the profiler is a diagnostic: its failure leaves the figures standing
            kernels = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        **({"bw_kernel_profile": kernels} if kernels else {}),
        **{f"bw_{k}": v for k, v in parts.items()},
        **{f"bw_{k.removesuffix('_s')}_vs_limit": v / limit for k, v in parts.items()},
        "decode_vs_bw_limit": step / limit,
        "bw_decode_step_s": step,
        "bw_limit_step_s": limit,
        "bw_copy_bytes_s": bandwidth,
        "bw_weight_bytes_read": weight_read,
        "bw_kv_bytes_read": kv_per_token * mean_context,
        "bw_decode_steps": len(steps),
        "bw_cuda_graph_replays": graphs.num_replays if graphs is not None else 0,
        "bw_setup": "batch 1, greedy, median engine decode turn; bandwidth: median 1 GiB device copy, "
                    "read + write counted; KV at the mean context of the run; parts: runner_step = "
                    "ModelRunner.forward + greedy pick to the host, one step at a time; device_step = the "
                    "same forward queued back to back, one sync at the end (the slower of host launch work and device time)",
    }


def step_parts(engine, name: str, context: int, steps: int = 48) -> dict:
    """Where a decode step's time goes, below the engine: the runner's step as the engine takes
    it (prepare, forward, greedy token to the host), and the same forward queued back to back
    with one sync at the end: the slower of the host's launch work and the device's own time.
    engine step - runner_step = the engine's own work per step; runner_step - device_step =
    host time the device waits for each step."""
    from actors.model_runner import SeqChunk

    m = engine.models[name]
    params = engine.slots.params(name)
    device = engine.device
    blocks = list(range(-(-(context + steps + 1) // 16)))   # a fresh request would get some blocks; any will do
    chunk = lambda i: [SeqChunk([11 + i % 100], context + i, blocks)]   # noqa: E731
    for i in range(3):
        m.runner.forward(params, chunk(i), m.kv).argmax(-1).tolist()   # the bucket's graph captured
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        m.runner.forward(params, chunk(i), m.kv).argmax(-1).tolist()
    runner_step = (time.perf_counter() - start) / steps
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        m.runner.forward(params, chunk(i), m.kv)
    sync(device)
    device_step = (time.perf_counter() - start) / steps
    return {"runner_step_s": runner_step, "device_step_s": device_step}


def kernel_profile(engine, name: str, context: int, steps: int = 3) -> dict:
    """The device kernels of one eager decode forward at batch 1 (torch.profiler): how many, how
    long on the device in all, and the ten that take longest by name. A graph replays the same
    kernels; their count times a few microseconds each is what small kernels cost per step."""
    from torch.profiler import ProfilerActivity, profile

    from actors.model_runner import SeqChunk

    m = engine.models[name]
    params = engine.slots.params(name)
    blocks = list(range(-(-(context + 2) // 16)))
    step = m.runner._prepare([SeqChunk([11], context, blocks)], m.kv, m.dtype)
    m.runner._forward_step(params, step, m.kv)
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            m.runner._forward_step(params, step, m.kv)
        sync(engine.device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count > 0]
    total_us = sum(e.self_device_time_total for e in events) / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:10]
    return {"kernels_per_step": sum(e.count for e in events) / steps, "device_us_per_step": total_us,
            "top": [{"name": e.key[:80], "per_step": e.count / steps, "us_per_step": e.self_device_time_total / steps}
                    for e in top]}
