"""Metrics overhead: the engine loop with recording on against the same loop with it off.

The engine runs as a DeviceWorker runs it: on an EngineLoop thread (actors/worker.py),
kept busy with a constant load (every model always has `requests_per_model` requests in
flight: each one that finishes is replaced at once), with the worker's metrics thread
(actors/worker_metrics.py) taking a sample between steps every `flush_interval_s` and
exporting the merged samples through `ray.util.metrics` as often as Ray reports metrics (to a
Ray started for this section with its defaults, so the Ray calls cost what they cost in a
worker). Recording is switched on and off ("off": a NullRecorder and no flushes) in
alternating windows of `window_s` seconds of the same run (0.3 s by default), the order
flipped every pair, so the machine's other load, which drifts over seconds, hits both sides of a
pair alike: short windows keep the two sides of a pair close in time, and many pairs average the
noise that remains (on a shared 2-core VM a fixed matmul loop's rate varies by 12% from one
second to the next). The default on/off cycle (4 windows, 1.2 s) is not a multiple of the flush
interval (1 s), so the flushes fall in "on" and "off" windows alike and the "on" windows get
their share (`metrics_setup.flushes_per_on_s`, about 1 / flush_interval_s). The metrics thread
exports once `export_interval_s` of wall time has passed, but only from "on" windows, which hold
half of the wall time: the exports are counted about twice over, an overstatement kept because it
errs against the claim.

  metrics_overhead_frac       (engine-loop wall seconds per generated token, summed over the
                              "on" windows) / (the same over the "off" windows) - 1: what
                              recording costs the hot loop, i.e. the recording in each step,
                              the samples taken between steps, the exports and the metrics
                              thread's contention for the GIL; 95% CI: bootstrap over pairs
                              (the pooled ratio recomputed on pairs drawn with replacement)
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
import time
from pathlib import Path

import torch

from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion
from load_tests.stats import bootstrap_ci

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


def _lengths(new_tokens: int) -> tuple[int, int]:
    """The range the constant load draws its requests' lengths from (see _ConstantLoad)."""
    return max(1, new_tokens // 2), new_tokens * 3 // 2


class _ConstantLoad:
    """Keeps `per_model` requests of every model in flight: `deliver` replaces each finished one.

    Each request asks for a length drawn from [new_tokens / 2, 3 * new_tokens / 2] (seeded), so
    requests finish at scattered steps and the load is the same from one second to the next;
    equal lengths would finish them all together, in waves of prefills about a second apart,
    and a one-second window would then see a different mix of steps from the next.
    """

    def __init__(self, engine, models: list[str], prompts: list[list[int]], new_tokens: int, seed: int = 0):
        self.engine, self.models, self.prompts, self.new_tokens = engine, models, prompts, new_tokens
        self._rng = random.Random(seed)
        self.tokens = 0          # generated so far (engine thread writes, main thread reads)
        self.error: str | None = None
        self._next = 0
        self._model_of: dict[str, str] = {}

    def request(self, model: str):
        self._next += 1
        prompt = self.prompts[self._next % len(self.prompts)]
        length = self._rng.randint(*_lengths(self.new_tokens))
        req = greedy_requests(model, [prompt], length, f"load{self._next}")[0]
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
        flush0, flushes0 = metrics.flush_cpu_s, metrics.flushes
        tokens0, steps0, step_s0 = load.tokens, engine.num_steps, engine.step_seconds
        wall0, cpu0 = time.perf_counter(), time.process_time()
        time.sleep(window_s)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        windows.append({"on": on, "pair": i // 2, "tokens": load.tokens - tokens0, "wall_s": wall, "cpu_s": cpu,
                        "steps": engine.num_steps - steps0, "step_s": engine.step_seconds - step_s0,
                        "record_s": recorder.seconds if on else 0.0, "flush_cpu_s": metrics.flush_cpu_s - flush0,
                        "flushes": metrics.flushes - flushes0})
        if load.error:
            raise RuntimeError(f"a request of the load failed: {load.error}")
    return windows


class _SwitchableFlush:
    """The worker's flush, skipped while recording is off, its CPU time summed."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.enabled = False
        self.flush_cpu_s = 0.0
        self.flushes = 0

    def __call__(self) -> None:
        if self.enabled:
            start = time.thread_time()   # this thread's CPU, not its wait for the engine thread
            self.metrics.flush()
            self.flush_cpu_s += time.thread_time() - start
            self.flushes += 1


def _pooled(pairs: list[tuple[dict, dict]], cost: str, per: str) -> float:
    """(sum of `cost` / sum of `per`) over the "on" windows against the same over the "off" ones, - 1."""
    def rate(side: int) -> float:
        return sum(p[side][cost] for p in pairs) / sum(p[side][per] for p in pairs)
    return rate(0) / rate(1) - 1


def measure_metrics_overhead(paths: dict[str, Path], *, device: torch.device, dtype: str | None, num_slots: int,
                             requests_per_model: int, new_tokens: int, prompt_tokens: int, host_cache,
                             pairs: int = 500, window_s: float = 0.3, flush_interval_s: float = 1.0,
                             kernels: str = "fast") -> dict:
    import ray

    from actors.worker import EngineLoop
    from actors.worker_metrics import WorkerMetrics

    prompts = make_prompts(requests_per_model, prompt_tokens, seed=3)
    max_len = max(map(len, prompts))
    longest = max_len + _lengths(new_tokens)[1]
    engine = engine_for(paths, num_slots=num_slots, tokens_per_model=requests_per_model * longest, device=device,
                        dtype=dtype, host_cache=host_cache, kernels=kernels)
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
    switch = _SwitchableFlush(metrics)
    metrics._thread.tick = switch
    try:
        for name in paths:
            for _ in range(requests_per_model):
                loop.call(engine.add_request, load.request(name))
        time.sleep(max(window_s, 5.0))   # reach the steady state before measuring
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
    ons = [on for on, _ in pairs_]
    on_step_s, on_wall_s = sum(w["step_s"] for w in ons), sum(w["wall_s"] for w in ons)
    figures = {}
    for key, cost, per in (("metrics_overhead_frac", "wall_s", "tokens"),
                           ("metrics_cpu_overhead_frac", "cpu_s", "tokens"),
                           ("metrics_step_overhead_frac", "step_s", "steps")):
        figures[key] = _pooled(pairs_, cost, per)
        figures[f"{key}_ci95"] = bootstrap_ci(pairs_, lambda drawn, cost=cost, per=per: _pooled(drawn, cost, per))
    return {
        **figures,
        "metrics_record_frac": sum(w["record_s"] for w in ons) / on_step_s,
        "metrics_flush_frac": sum(w["flush_cpu_s"] for w in ons) / on_wall_s,
        "metrics_pairs": pairs,
        "metrics_mean_step_ms": 1e3 * on_step_s / sum(w["steps"] for w in ons),
        "metrics_tokens_per_s": sum(w["tokens"] for w in ons) / on_wall_s,
        "metrics_setup": {"models": sorted(paths), "num_slots": num_slots, "requests_per_model": requests_per_model,
                          "new_tokens": list(_lengths(new_tokens)),
                          "flush_interval_s": flush_interval_s, "export_interval_s": metrics.export_interval_s,
                          "exports": metrics.num_exports,
                          "window_s": window_s,
                          "flushes_per_on_s": sum(w["flushes"] for w in ons) / on_wall_s,
                          "measure": "alternating on/off windows of one run; ratio of the pooled 'on' and 'off' "
                                     "rates; CI: bootstrap over pairs, seed 0"},
    }


def _with_arrival(req, now: float):
    """The same request with an arrival time, so TTFT and e2e latency are recorded as in serving."""
    from dataclasses import replace

    return replace(req, arrival_time=now)
