"""Metrics overhead: the engine loop with recording on against the same loop with it off.

The engine runs as a DeviceWorker runs it: on an EngineLoop thread (actors/worker.py),
kept busy with a constant load (every model always has `requests_per_model` requests in
flight: each one that finishes is replaced at once), with the worker's metrics thread
(actors/worker_metrics.py) taking a sample between steps every `flush_interval_s` and
exporting the merged samples through `ray.util.metrics` as often as Ray reports metrics (to a
Ray started for this section with its defaults, so the Ray calls cost what they cost in a
worker). Recording is switched on and off ("off": a NullRecorder and no flushes) in
alternating windows of `window_s` seconds of the same run (default: the export interval, so
every "on" window holds one export), the order flipped every pair, so the machine's other
load, which drifts over seconds, hits both sides of a pair alike.

  metrics_overhead_frac       median over pairs of (engine-loop wall seconds per generated token,
                              on / off) - 1: what recording costs the hot loop, i.e. the
                              recording in each step, the samples taken between steps and the
                              metrics thread's contention for the GIL; 95% bootstrap CI of the
                              median
  metrics_cpu_overhead_frac   the same on the whole process's CPU seconds per token: also
                              counts the metrics thread's own CPU, spent beside the hot loop
                              (on another core when there is one)
  metrics_step_overhead_frac  the same on Engine.step_seconds per step (time inside step())
  metrics_record_frac         seconds inside the recorder's on_step / step seconds, timed
                              directly in the "on" windows (no run-to-run noise)
  metrics_flush_frac          CPU seconds of the metrics thread's flushes / wall time of "on"
"""
from __future__ import annotations

import logging
import random
import statistics
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


class _ConstantLoad:
    """Keeps `per_model` requests of every model in flight: `deliver` replaces each finished one."""

    def __init__(self, engine, models: list[str], prompts: list[list[int]], new_tokens: int):
        self.engine, self.models, self.prompts, self.new_tokens = engine, models, prompts, new_tokens
        self.tokens = 0          # generated so far (engine thread writes, main thread reads)
        self.error: str | None = None
        self._next = 0
        self._model_of: dict[str, str] = {}

    def request(self, model: str):
        self._next += 1
        prompt = self.prompts[self._next % len(self.prompts)]
        req = greedy_requests(model, [prompt], self.new_tokens, f"load{self._next}")[0]
        self._model_of[req.request_id] = model
        return _with_arrival(req, time.time())

    def deliver(self, frames) -> None:   # on the engine thread: add_request is safe here
        for frame in frames:
            self.tokens += len(frame.token_ids)
            if frame.error:
                self.error = frame.error
            if frame.finished:
                self.engine.add_request(self.request(self._model_of.pop(frame.request_id)))


def _windows(engine, load: _ConstantLoad, metrics, pairs: int, window_s: float) -> list[dict]:
    """Alternate recording on/off every window_s; per window: tokens, CPU, wall, step time."""
    from actors.engine_metrics import EngineRecorder, NullRecorder

    windows = []
    for i in range(2 * pairs):
        on = (i % 2 == 0) == ((i // 2) % 2 == 0)     # on,off then off,on, ...
        recorder = _TimedRecorder(EngineRecorder()) if on else NullRecorder()
        engine.metrics = recorder
        metrics.enabled = on
        flush0, tokens0, steps0, step_s0 = metrics.flush_cpu_s, load.tokens, engine.num_steps, engine.step_seconds
        wall0, cpu0 = time.perf_counter(), time.process_time()
        time.sleep(window_s)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        windows.append({"on": on, "pair": i // 2, "tokens": load.tokens - tokens0, "wall_s": wall, "cpu_s": cpu,
                        "steps": engine.num_steps - steps0, "step_s": engine.step_seconds - step_s0,
                        "record_s": recorder.seconds if on else 0.0, "flush_cpu_s": metrics.flush_cpu_s - flush0})
        if load.error:
            raise RuntimeError(f"a request of the load failed: {load.error}")
    return windows


class _SwitchableFlush:
    """The worker's flush, skipped while recording is off, its CPU time summed."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.enabled = False
        self.flush_cpu_s = 0.0

    def __call__(self) -> None:
        if self.enabled:
            start = time.thread_time()   # this thread's CPU, not its wait for the engine thread
            self.metrics.flush()
            self.flush_cpu_s += time.thread_time() - start


def _ci(values: list[float], seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def measure_metrics_overhead(paths: dict[str, Path], *, device: torch.device, dtype: str | None, num_slots: int,
                             requests_per_model: int, new_tokens: int, prompt_tokens: int, host_cache,
                             pairs: int = 15, window_s: float | None = None, flush_interval_s: float = 1.0,
                             kernels: str = "fast") -> dict:
    import ray

    from actors.worker import EngineLoop
    from actors.worker_metrics import WorkerMetrics

    prompts = make_prompts(requests_per_model, prompt_tokens, seed=3)
    max_len = max(map(len, prompts))
    engine = engine_for(paths, num_slots=num_slots, tokens_per_model=requests_per_model * (max_len + new_tokens),
                        device=device, dtype=dtype, host_cache=host_cache, kernels=kernels)
    run_to_completion(engine, [r for name in paths for r in greedy_requests(name, prompts[:1], 2, "warm")])
    started_ray = not ray.is_initialized()
    if started_ray:   # a Ray for the metrics calls only: they then cost what they cost in a worker
        import os

        from cluster.ray_runtime import DRIVER_ENV

        for key, value in DRIVER_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    load = _ConstantLoad(engine, list(paths), prompts, new_tokens)
    loop = EngineLoop(engine, load.deliver)
    metrics = WorkerMetrics("bench-gpu0", engine, loop, torch.get_num_threads(), flush_interval_s)
    window_s = window_s or metrics.export_interval_s
    switch = _SwitchableFlush(metrics)
    metrics._thread.tick = switch
    try:
        for name in paths:
            for _ in range(requests_per_model):
                loop.call(engine.add_request, load.request(name))
        time.sleep(window_s)   # reach the steady state before measuring
        windows = _windows(engine, load, switch, pairs, window_s)
    finally:
        metrics.stop()
        loop.stop()
        if started_ray:
            ray.shutdown()
    by_pair: dict[int, dict[bool, dict]] = {}
    for w in windows:
        by_pair.setdefault(w["pair"], {})[w["on"]] = w
    pairs_ = [(p[True], p[False]) for p in by_pair.values()]
    cpu = [on["cpu_s"] / on["tokens"] / (off["cpu_s"] / off["tokens"]) - 1 for on, off in pairs_]
    wall = [on["wall_s"] / on["tokens"] / (off["wall_s"] / off["tokens"]) - 1 for on, off in pairs_]
    step = [on["step_s"] / on["steps"] / (off["step_s"] / off["steps"]) - 1 for on, off in pairs_]
    ons = [on for on, _ in pairs_]
    on_step_s = sum(w["step_s"] for w in ons)
    return {
        "metrics_overhead_frac": statistics.median(wall),
        "metrics_overhead_frac_ci95": _ci(wall),
        "metrics_cpu_overhead_frac": statistics.median(cpu),
        "metrics_cpu_overhead_frac_ci95": _ci(cpu),
        "metrics_step_overhead_frac": statistics.median(step),
        "metrics_step_overhead_frac_ci95": _ci(step),
        "metrics_record_frac": sum(w["record_s"] for w in ons) / on_step_s,
        "metrics_flush_frac": sum(w["flush_cpu_s"] for w in ons) / sum(w["wall_s"] for w in ons),
        "metrics_pairs": pairs,
        "metrics_mean_step_ms": 1e3 * on_step_s / sum(w["steps"] for w in ons),
        "metrics_tokens_per_s": sum(w["tokens"] for w in ons) / sum(w["wall_s"] for w in ons),
        "metrics_setup": {"models": sorted(paths), "num_slots": num_slots, "requests_per_model": requests_per_model,
                          "new_tokens": new_tokens, "flush_interval_s": flush_interval_s,
                          "export_interval_s": metrics.export_interval_s, "exports": metrics.num_exports,
                          "window_s": window_s,
                          "measure": "alternating on/off windows of one run; median of per-pair ratios; "
                                     "CI: bootstrap of the median, seed 0"},
    }


def _with_arrival(req, now: float):
    """The same request with an arrival time, so TTFT and e2e latency are recorded as in serving."""
    from dataclasses import replace

    return replace(req, arrival_time=now)
