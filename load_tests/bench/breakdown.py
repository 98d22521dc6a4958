"""Where an Engine step's time goes, by timing the engine's own parts in place.

`instrument(engine)` wraps, on this engine instance only, the calls `Engine.step` makes:
policy.schedule, _prepare (weights resident + KV swaps + prefetch), each model runner's
forward, sampler.sample, policy.update, policy.set_resident and _emit. The wrappers
only add a perf_counter pair each (and, on CUDA, a synchronize after the forward, which
the sampler's `.tolist()` would wait for anyway), so the engine runs its real code.
`Engine.forward_seconds` times `_run`, which is chunk building + forward + sampling;
`runner_forward` here is the forward alone.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch

PARTS = ("schedule", "prepare", "runner_forward", "sample", "update", "set_resident", "emit")


class StepBreakdown:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, part: str, fn, device: torch.device | None = None):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                return out
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, step_seconds: float) -> dict:
        """Seconds per part and their shares of `step_seconds`; `rest` is what no part covers."""
        parts = {p: self.seconds.get(p, 0.0) for p in PARTS}
        parts["rest"] = max(0.0, step_seconds - sum(parts.values()))
        return {"seconds": parts, "share": {p: s / step_seconds if step_seconds else 0.0 for p, s in parts.items()}}


def instrument(engine) -> StepBreakdown:
    b = StepBreakdown()
    policy = engine.policy
    policy.schedule = b.wrap("schedule", policy.schedule)
    policy.update = b.wrap("update", policy.update)
    policy.set_resident = b.wrap("set_resident", policy.set_resident)
    engine._prepare = b.wrap("prepare", engine._prepare)
    engine._emit = b.wrap("emit", engine._emit)
    engine.sampler.sample = b.wrap("sample", engine.sampler.sample)
    for m in engine.models.values():
        m.runner.forward = b.wrap("runner_forward", m.runner.forward, engine.device)
    return b


class EngineCounters:
    """Engine.num_steps / forward_seconds / step_seconds over an interval (they only grow)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.start = (engine.num_steps, engine.forward_seconds, engine.step_seconds)

    def delta(self) -> tuple[int, float, float]:
        e, (n, f, s) = self.engine, self.start
        return e.num_steps - n, e.forward_seconds - f, e.step_seconds - s
