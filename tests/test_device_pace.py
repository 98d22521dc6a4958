"""A paced virtual device (actors/device_pace.py): each forward and swap-in takes `slowdown` x
the CPU time its thread spent, the rest slept; slowdown 1 is the real device, untouched."""
from __future__ import annotations

import pytest

from actors.device_pace import DevicePace
from actors.engine import Engine, EngineConfig
from actors.zoo.zoo import ensure_model
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

MiB = 1 << 20


class FakeClocks:
    """A thread CPU clock the body advances, and a sleep that records its pauses."""

    def __init__(self):
        self.cpu, self.slept = 0.0, []

    def sleep(self, s: float) -> None:
        self.slept.append(s)


def test_a_paced_span_sleeps_slowdown_minus_one_times_its_cpu_time():
    clocks = FakeClocks()
    pace = DevicePace(4.0, cpu_clock=lambda: clocks.cpu, sleep=clocks.sleep)
    with pace.paced() as span:
        clocks.cpu += 0.010
    assert span.extra_s == pytest.approx(0.030)
    assert clocks.slept == [pytest.approx(0.030)]
    with pace.paced():
        pass   # no CPU time: no pause
    assert clocks.slept == [pytest.approx(0.030)]
    assert pace.num_paced == 2 and pace.slept_s == pytest.approx(0.030)


def test_slowdown_one_never_sleeps_and_bad_slowdowns_are_refused():
    clocks = FakeClocks()
    pace = DevicePace(1.0, cpu_clock=lambda: clocks.cpu, sleep=clocks.sleep)
    with pace.paced() as span:
        clocks.cpu += 1.0
    assert span.extra_s == 0.0 and clocks.slept == [] and not pace.active
    for bad in (0.5, 0.0, -2, float("inf"), float("nan"), "4"):
        with pytest.raises(ValueError, match="device_slowdown"):
            DevicePace(bad)
    with pytest.raises(ValueError, match="device_slowdown"):
        EngineConfig(device_slowdown=0.9)


def test_a_paced_engine_gives_the_same_tokens_and_its_steps_take_slowdown_times_their_cpu():
    """The same greedy tokens on a paced and a real device; on the paced one every step's
    recorded time includes its pause (the estimator and the router see the slow device)."""
    path = str(ensure_model("llama-tiny-a"))
    out = {}
    for slowdown in (1.0, 3.0):
        engine = Engine(EngineConfig(budget_bytes=64 * MiB, kv_bytes=16 * MiB, num_slots=1,
                                     slab_bytes=256 * 1024, host_kv_bytes=0, device_slowdown=slowdown))
        engine.register_model("a", path)
        engine.register_model("b", path)
        for i, model in enumerate("abab"):
            engine.add_request(GenerateRequest(f"r{i}", model, [5 + i, 9, 13, 21],
                                               SamplingParams(max_tokens=6, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for frame in engine.step():
                tokens.setdefault(frame.request_id, []).extend(frame.token_ids)
        out[slowdown] = (tokens, engine)
    assert out[3.0][0] == out[1.0][0]
    paced = out[3.0][1]
    assert paced.pace.num_paced >= paced.num_steps            # every forward (and each switch) paced
    assert out[1.0][1].pace.num_paced == 0
    # the pauses are 2x the paced CPU time, so they are 2/3 of the paced spans: more than half
    # of the step time on the paced engine
    assert paced.pace.slept_s > 0.5 * paced.step_seconds
