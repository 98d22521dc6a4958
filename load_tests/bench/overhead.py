"""Scheduler overhead: the share of an Engine step's wall time spent outside the model
forward, with several models active at once.

Every model gets `requests_per_model` greedy requests, all submitted together, and the
engine steps until they finish (the token-level policy switches models between steps).
That run is repeated `repeats` times on the same (warm) engine, uninstrumented, then once
more with the step breakdown's wrappers, which add time of their own outside the forward
and so are kept out of the headline:

  scheduler_overhead_frac         1 - Engine.forward_seconds / Engine.step_seconds: the
                                  engine's own counters; the mean of the repeats, with its
                                  95% interval and every run beside it. forward_seconds
                                  times `_run`, so chunk building and sampling count as
                                  "forward" there.
  scheduler_overhead_frac_strict  1 - (runner forward alone) / step_seconds: sampling and
                                  chunk building count as overhead (see breakdown.py; the
                                  instrumented run).
  loop_overhead_frac              1 - (runner forward alone) / wall time of the whole loop,
                                  which also sees the time between steps (instrumented run).

With `num_slots` > number of models every model stays resident after the warm-up and the
figures measure scheduling alone; with fewer slots they include waiting for swap-ins.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion, sync

logger = logging.getLogger(__name__)


def measure_overhead(paths: dict[str, Path], *, device: torch.device, dtype: str | None, num_slots: int,
                     requests_per_model: int, new_tokens: int, prompt_tokens: int, host_cache,
                     kernels: str = "fast", repeats: int = 5) -> dict:
    from load_tests.bench.breakdown import EngineCounters, instrument
    from load_tests.stats import mean_ci

    prompts = make_prompts(requests_per_model, prompt_tokens, seed=2)
    max_len = max(map(len, prompts))
    engine = engine_for(paths, num_slots=num_slots, tokens_per_model=requests_per_model * (max_len + new_tokens),
                        device=device, dtype=dtype, host_cache=host_cache, kernels=kernels)
    warm = [r for name in paths for r in greedy_requests(name, prompts[:1], 2, "warm")]
    run_to_completion(engine, warm)   # first-call allocations; every model through a slot once

    def one_run(tag: str) -> tuple[float, int, float, float]:
        counters = EngineCounters(engine)
        requests = [r for name in paths for r in greedy_requests(name, prompts, new_tokens, tag)]
        sync(device)
        start = time.perf_counter()
        tokens = run_to_completion(engine, requests)
        sync(device)
        wall = time.perf_counter() - start
        generated = sum(map(len, tokens.values()))
        if generated != len(requests) * new_tokens:
            raise RuntimeError(f"generated {generated} tokens, expected {len(requests) * new_tokens}")
        return (wall, *counters.delta())

    swaps_before = engine.slots.stats()["num_swaps"]
    fracs = []
    for i in range(repeats):
        _, _, forward_s, step_s = one_run(f"run{i}")
        fracs.append(1 - forward_s / step_s)
    breakdown = instrument(engine)
    wall, num_steps, forward_s, step_s = one_run("instrumented")
    runner_s = breakdown.seconds.get("runner_forward", 0.0)
    generated = len(paths) * requests_per_model * new_tokens   # one_run checked it
    ci = mean_ci(fracs)
    return {
        "scheduler_overhead_frac": ci.mean,
        "scheduler_overhead_frac_ci95": [ci.lo, ci.hi],
        "scheduler_overhead_frac_runs": fracs,
        "scheduler_overhead_frac_instrumented": 1 - forward_s / step_s,
        "scheduler_overhead_frac_strict": 1 - runner_s / step_s,
        "loop_overhead_frac": 1 - runner_s / wall,
        "num_models": len(paths),
        "num_slots": num_slots,
        "num_swaps": engine.slots.stats()["num_swaps"] - swaps_before,   # over all the runs
        "num_steps": num_steps,
        "mean_step_ms": 1e3 * step_s / max(1, num_steps),
        "mean_forward_ms": 1e3 * runner_s / max(1, num_steps),
        "tokens_per_s": generated / wall,
        "wall_s": wall,
        "breakdown": breakdown.report(step_s),
        "setup": {"requests_per_model": requests_per_model, "new_tokens": new_tokens, "repeats": repeats,
                  "models": sorted(paths), "policy": engine.config.policy},
    }
