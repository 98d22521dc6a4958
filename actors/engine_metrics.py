"""The engine's metrics recorder: plain counters on the engine thread, exported off it.

    Engine.step() -> recorder.on_step(output, switch_s, start)      hot path: appends and adds
    flusher thread -> engine_loop.call(take_sample, engine)         once a second, between steps
                   -> export_sample(merged samples, exporter)       ray.util.metrics, off the engine thread,
                                                                    as often as Ray exports (10 s)

`on_step` reads what a step left on its requests (the token just appended and its time) and
only appends floats to lists and adds to ints of a per-model accumulator: no Ray call, no
lock, no histogram binning, nothing per token beyond one list append. `take_sample` runs on
the engine thread too (so the engine's state cannot change under it): it swaps the
accumulators out and reads the gauges (queues, KV usage, alpha, quotas, swap counters).
Binning into histograms and the Ray calls happen on the flusher thread.

Definitions. A request's first token gives TTFT (arrival -> token) and counts its prompt;
each later token gives one inter-token gap (a resumed or handed-off request's first gap
here includes the pause). A turn is a maximal run of consecutive steps of one model (it
ends when another model's step starts, or the engine idles for IDLE_GAP_S); its length
runs from its first step's start to its last step's end, a switch wait included. A prefetch
hit is a switch to the model the previous step named as `prefetch_model`. Requests with
an unknown arrival time (0.0) give no TTFT or e2e latency.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.request import RequestStatus

IDLE_GAP_S = 0.05   # a pause between steps longer than this ends the turn

_ABORTED = RequestStatus.FINISHED_ABORTED
_DONE = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}


class ModelAccumulator:
    """What one model's steps left since the last sample."""

    __slots__ = ("ttft", "itl", "e2e", "turns", "prompt_tokens", "generation_tokens", "finished", "switches",
                 "prefetch_hits", "swap_wait_s", "busy_s", "handoffs", "handoffs_kept", "handoff_bytes",
                 "handoff_s")

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.turns: list[float] = []
        self.handoff_s: list[float] = []
        self.prompt_tokens = self.generation_tokens = self.switches = self.prefetch_hits = 0
        self.handoffs = self.handoffs_kept = self.handoff_bytes = 0
        self.swap_wait_s = self.busy_s = 0.0
        self.finished: dict[str, int] = {}

    def merge(self, later: "ModelAccumulator") -> "ModelAccumulator":
        """Add a later accumulator of the same model into this one; returns self."""
        for name in ("ttft", "itl", "e2e", "turns", "handoff_s"):
            getattr(self, name).extend(getattr(later, name))
        for name in ("prompt_tokens", "generation_tokens", "switches", "prefetch_hits", "handoffs", "handoffs_kept",
                     "handoff_bytes", "swap_wait_s", "busy_s"):
            setattr(self, name, getattr(self, name) + getattr(later, name))
        _add_counts(self.finished, later.finished)
        return self


def _add_counts(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Add the counts of `more` into `into`, key by key; returns `into`."""
    for key, n in more.items():
        into[key] = into.get(key, 0) + n
    return into


@dataclass
class EngineSample:
    """One flush worth of an engine's metrics (counters are deltas since the previous sample)."""

    models: dict[str, ModelAccumulator]
    running: dict[str, int]
    waiting: dict[str, int]
    kv_usage: float
    alpha: float | None
    quotas: dict[str, float]
    swaps: dict[str, int]            # weight copies per model since the previous sample
    swap_bytes: dict[str, int]
    wall_s: float = field(default=0.0)   # seconds this sample covers

    def merge(self, later: "EngineSample") -> "EngineSample":
        """One sample covering this one and the `later` one that follows it: deltas add up,
        gauges (queues, KV usage, alpha, quotas) are the later one's. Consumes both."""
        models = self.models
        for model, acc in later.models.items():
            mine = models.get(model)
            models[model] = acc if mine is None else mine.merge(acc)
        swaps = _add_counts(dict(self.swaps), later.swaps)
        swap_bytes = _add_counts(dict(self.swap_bytes), later.swap_bytes)
        return EngineSample(models=models, running=later.running, waiting=later.waiting, kv_usage=later.kv_usage,
                            alpha=later.alpha, quotas=later.quotas, swaps=swaps, swap_bytes=swap_bytes,
                            wall_s=self.wall_s + later.wall_s)


class EngineRecorder:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self._models: dict[str, ModelAccumulator] = {}
        self._last_model: str | None = None
        self._turn_start = 0.0
        self._turn_end = 0.0
        self._announced: str | None = None      # prefetch_model of the previous step
        self._handoffs: dict[str, float] = {}   # request id -> export start
        self._swaps_seen: dict[str, int] = {}
        self._sampled_at = clock()

    # -- hot path (engine thread) -----------------------------------------------------------

    def on_step(self, output, switch_s: float, start: float, steps: int = 1) -> None:
        """After a step's emit: `output` its SchedulerOutput, `start` its perf_counter start,
        `steps` how many steps of it ran (a multi-step decode run: one token per step each)."""
        now = self.clock()
        model = output.model
        acc = self._models.get(model) or self._acc(model)
        acc.busy_s += now - start
        if model != self._last_model or start - self._turn_end > IDLE_GAP_S:
            self._end_turn()
            if model != self._last_model and self._last_model is not None:
                acc.switches += 1
                if model == self._announced:
                    acc.prefetch_hits += 1
            self._last_model, self._turn_start = model, start
        self._turn_end = now
        self._announced = output.prefetch_model
        if switch_s:
            acc.swap_wait_s += switch_s
        partial = output.partial
        for r in output.requests:
            status = r.status
            if status is _ABORTED or r.request_id in partial:   # no token: aborted, or a chunk of its prompt
                continue
            times = r.token_times
            acc.generation_tokens += steps
            first = len(r.output_token_ids) - steps   # index of this step's (run's) first token
            if first == 0:
                acc.prompt_tokens += len(r.prompt_token_ids)
                if r.arrival_time:
                    acc.ttft.append(times[0] - r.arrival_time)
            if steps == 1:
                if first and len(times) > 1:
                    acc.itl.append(times[-1] - times[-2])
            else:
                acc.itl += [b - a for a, b in zip(times[max(first - 1, 0):-1], times[max(first, 1):])]
            reason = _DONE.get(status)
            if reason is not None:
                acc.finished[reason] = acc.finished.get(reason, 0) + 1
                if r.arrival_time:
                    acc.e2e.append(times[-1] - r.arrival_time)

    def _end_turn(self) -> None:
        if self._last_model is not None and self._turn_end > self._turn_start:
            self._acc(self._last_model).turns.append(self._turn_end - self._turn_start)

    def _acc(self, model: str) -> ModelAccumulator:
        acc = self._models.get(model)
        if acc is None:
            acc = self._models[model] = ModelAccumulator()
        return acc

    # -- KV handoff (engine thread, called by actors/handoff.py) -----------------------------

    def handoff_started(self, request_id: str) -> None:
        self._handoffs[request_id] = self.clock()

    def handoff_finished(self, request_id: str, model: str, nbytes: int, handed_off: bool) -> None:
        started = self._handoffs.pop(request_id, None)
        acc = self._acc(model)
        if not handed_off:
            acc.handoffs_kept += 1
            return
        acc.handoffs += 1
        acc.handoff_bytes += nbytes
        if started is not None:
            acc.handoff_s.append(self.clock() - started)

    # -- sampling (engine thread, between steps) ---------------------------------------------

    def take(self, engine) -> EngineSample:
        """Swap the accumulators out and read the engine's gauges."""
        models, self._models = self._models, {}
        now = self.clock()
        wall, self._sampled_at = now - self._sampled_at, now
        running: dict[str, int] = {m: 0 for m in engine.models}
        waiting: dict[str, int] = dict(running)
        for r in engine.requests.values():
            target = running if r.status is RequestStatus.RUNNING else waiting
            target[r.model] = target.get(r.model, 0) + 1
        usage = engine.blocks.usage()
        weights = engine.slots.stats()["swaps_per_model"]
        swaps = {m: n - self._swaps_seen.get(m, 0) for m, n in weights.items() if n > self._swaps_seen.get(m, 0)}
        self._swaps_seen = dict(weights)
        swap_bytes = {m: n * engine.models[m].layout.total_bytes for m, n in swaps.items() if m in engine.models}
        policy = engine.policy
        return EngineSample(models=models, running=running, waiting=waiting,
                            kv_usage=usage["used_bytes"] / max(1, usage["capacity_bytes"]),
                            alpha=getattr(policy, "last_alpha", None), quotas=dict(getattr(policy, "quotas", {})),
                            swaps=swaps, swap_bytes=swap_bytes, wall_s=wall)


class NullRecorder(EngineRecorder):
    """Records nothing: the 'off' side of the metrics overhead benchmark."""

    def on_step(self, output, switch_s: float, start: float, steps: int = 1) -> None:
        pass


def export_sample(sample: EngineSample, exporter, worker_id: str) -> int:
    """Send one sample to Ray metrics (flusher thread); returns the number of Ray calls made."""
    calls = 0

    def tags(model: str, **extra) -> dict[str, str]:
        return {"model": model, "worker": worker_id, **extra}

    for model, acc in sample.models.items():
        t = tags(model)
        for name, values in (("tokenmux_time_to_first_token_seconds", acc.ttft),
                             ("tokenmux_inter_token_latency_seconds", acc.itl),
                             ("tokenmux_e2e_request_latency_seconds", acc.e2e),
                             ("tokenmux_turn_seconds", acc.turns),
                             ("tokenmux_kv_handoff_seconds", acc.handoff_s)):
            exporter.observe_many(name, values, t)
            calls += len(values)
        for name, value in (("tokenmux_prompt_tokens_total", acc.prompt_tokens),
                            ("tokenmux_generation_tokens_total", acc.generation_tokens),
                            ("tokenmux_model_switches_total", acc.switches),
                            ("tokenmux_prefetch_hits_total", acc.prefetch_hits),
                            ("tokenmux_swap_wait_seconds_total", acc.swap_wait_s),
                            ("tokenmux_device_busy_seconds_total", acc.busy_s),
                            ("tokenmux_kv_handoff_bytes_total", acc.handoff_bytes)):
            exporter.inc(name, value, t)
            calls += 1
        for outcome, n in (("handed_off", acc.handoffs), ("kept", acc.handoffs_kept)):
            exporter.inc("tokenmux_kv_handoffs_total", n, tags(model, outcome=outcome))
        for reason, n in acc.finished.items():
            exporter.inc("tokenmux_request_success_total", n, tags(model, finished_reason=reason))
        calls += 2 + len(acc.finished)
    for model in sample.running:
        exporter.set("tokenmux_num_requests_running", sample.running[model], tags(model))
        exporter.set("tokenmux_num_requests_waiting", sample.waiting.get(model, 0), tags(model))
        calls += 2
    for model, n in sample.swaps.items():
        exporter.inc("tokenmux_swaps_total", n, tags(model))
        exporter.inc("tokenmux_swap_bytes_total", sample.swap_bytes.get(model, 0), tags(model))
        calls += 2
    for model, quota in sample.quotas.items():
        if quota != float("inf"):   # a batch alone has no quota (it runs until other work comes)
            exporter.set("tokenmux_turn_quota_seconds", quota, tags(model))
            calls += 1
    exporter.set("tokenmux_kv_cache_usage_perc", sample.kv_usage, {"worker": worker_id})
    if sample.alpha is not None:
        exporter.set("tokenmux_quota_alpha", sample.alpha, {"worker": worker_id})
    return calls + 2
