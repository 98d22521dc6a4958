"""Metrics overhead: the engine loop with recording on against the same loop with it off.

The engine runs as a DeviceWorker runs it: on an EngineLoop thread (actors/worker.py),
with the worker's metrics thread (actors/worker_metrics.py) taking a sample between steps
every `flush_interval_s` and exporting it with `ray.util.metrics` to a Ray started for
this section (so the Ray calls cost what they cost in a worker). "Off" swaps in a
NullRecorder and runs no metrics thread. The two arms alternate `pairs` times on the
same engine and workload (several models active, token-level switching), order flipped
every pair.

  metrics_overhead_frac       median over pairs of (process CPU seconds on / off) - 1 for the
                              same work: the recording in each step, the samples taken
                              between steps and the metrics thread's own CPU, all of them;
                              CPU time rather than wall time, so other load on a shared
                              machine does not swamp a 1% effect. 95% bootstrap CI.
  metrics_wall_overhead_frac  the same on the loop's wall time
  metrics_step_overhead_frac  the same on Engine.step_seconds per step (time inside step())
  metrics_record_frac         seconds inside the recorder's on_step / step seconds, timed
                              directly in the "on" arm (no run-to-run noise)
  metrics_flush_frac          CPU seconds of the metrics thread's flushes / wall time
"""
from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion

logger = logging.getLogger(__name__)


class _TimedRecorder:
    """Wraps EngineRecorder.on_step with a perf_counter pair (adds ~0.2 us a step to the 'on' arm)."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.seconds = 0.0

    def on_step(self, *args) -> None:
        start = time.perf_counter()
        self.recorder.on_step(*args)
        self.seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self.recorder, name)


def _run_loop(engine, requests, metrics_on: bool, flush_interval_s: float) -> dict:
    from actors.engine_metrics import EngineRecorder, NullRecorder
    from actors.worker import EngineLoop
    from actors.worker_metrics import WorkerMetrics

    recorder = _TimedRecorder(EngineRecorder()) if metrics_on else NullRecorder()
    engine.metrics = recorder
    remaining = {r.request_id for r in requests}
    done = threading.Event()

    def deliver(frames) -> None:
        for frame in frames:
            if frame.error:
                raise RuntimeError(f"request {frame.request_id} failed: {frame.error}")
            if frame.finished:
                remaining.discard(frame.request_id)
        if not remaining:
            done.set()

    steps0, step_s0 = engine.num_steps, engine.step_seconds
    loop = EngineLoop(engine, deliver)
    metrics = WorkerMetrics("bench-gpu0", engine, loop, torch.get_num_threads(), flush_interval_s) \
        if metrics_on else None
    flush_s = [0.0]
    if metrics is not None:   # time each flush (the thread's share of the machine)
        inner = metrics.flush

        def timed_flush() -> None:
            start = time.thread_time()   # this thread's CPU, not its wait for the engine thread
            inner()
            flush_s[0] += time.thread_time() - start

        metrics._thread.tick = timed_flush
    start, cpu_start = time.perf_counter(), time.process_time()
    for r in requests:
        loop.call(engine.add_request, r)
    if not done.wait(600):
        raise RuntimeError("the engine loop did not finish the workload in 600 s")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if metrics is not None:
        metrics.stop()
    loop.stop()
    steps, step_s = engine.num_steps - steps0, engine.step_seconds - step_s0
    return {"wall_s": wall, "cpu_s": cpu, "step_s": step_s, "num_steps": steps,
            "record_s": recorder.seconds if metrics_on else 0.0, "flush_s": flush_s[0],
            "flushes": metrics.num_flushes if metrics is not None else 0}


def _ci(values: list[float], seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def measure_metrics_overhead(paths: dict[str, Path], *, device: torch.device, dtype: str | None, num_slots: int,
                             requests_per_model: int, new_tokens: int, prompt_tokens: int, host_cache,
                             pairs: int = 7, flush_interval_s: float = 1.0) -> dict:
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:   # a Ray for the metrics calls only: they then cost what they cost in a worker
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        prompts = make_prompts(requests_per_model, prompt_tokens, seed=3)
        max_len = max(map(len, prompts))
        engine = engine_for(paths, num_slots=num_slots, tokens_per_model=requests_per_model * (max_len + new_tokens),
                            device=device, dtype=dtype, host_cache=host_cache)
        run_to_completion(engine, [r for name in paths for r in greedy_requests(name, prompts[:1], 2, "warm")])
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for i in range(pairs):
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                now = time.time()
                requests = [_with_arrival(r, now) for name in paths
                            for r in greedy_requests(name, prompts, new_tokens, f"{arm}{i}")]
                runs[arm].append(_run_loop(engine, requests, arm == "on", flush_interval_s))
    finally:
        if started_ray:
            ray.shutdown()
    cpu = [on["cpu_s"] / off["cpu_s"] - 1 for on, off in zip(runs["on"], runs["off"])]
    wall = [on["wall_s"] / off["wall_s"] - 1 for on, off in zip(runs["on"], runs["off"])]
    step = [on["step_s"] / on["num_steps"] / (off["step_s"] / off["num_steps"]) - 1
            for on, off in zip(runs["on"], runs["off"])]
    on_step_s = sum(r["step_s"] for r in runs["on"])
    return {
        "metrics_overhead_frac": statistics.median(cpu),
        "metrics_overhead_frac_ci95": _ci(cpu),
        "metrics_wall_overhead_frac": statistics.median(wall),
        "metrics_wall_overhead_frac_ci95": _ci(wall),
        "metrics_step_overhead_frac": statistics.median(step),
        "metrics_step_overhead_frac_ci95": _ci(step),
        "metrics_record_frac": sum(r["record_s"] for r in runs["on"]) / on_step_s,
        "metrics_flush_frac": sum(r["flush_s"] for r in runs["on"]) / sum(r["wall_s"] for r in runs["on"]),
        "metrics_pairs": pairs,
        "metrics_mean_step_ms": 1e3 * on_step_s / sum(r["num_steps"] for r in runs["on"]),
        "metrics_flushes": sum(r["flushes"] for r in runs["on"]),
        "metrics_setup": {"models": sorted(paths), "num_slots": num_slots, "requests_per_model": requests_per_model,
                          "new_tokens": new_tokens, "flush_interval_s": flush_interval_s,
                          "measure": "median over alternating on/off pairs; CI: bootstrap of the median, seed 0"},
    }


def _with_arrival(req, now: float):
    """The same request with an arrival time, so TTFT and e2e latency are recorded as in serving."""
    from dataclasses import replace

    return replace(req, arrival_time=now)
