"""One bad request fails only itself: validation refuses poison at the typed messages, and a
poisoned request that reaches a real engine anyway (validation bypassed) ends with an error
of its own while every innocent request on the device completes exactly as it would have
without it (greedy and seeded outputs equal an undisturbed run)."""
from __future__ import annotations

import math

import pytest

from actors.engine import Engine, EngineConfig
from actors.weight_layout import WeightLayout
from scheduler.messages import FINISH_ERROR, GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

MiB = 1 << 20
MODELS = ("llama-tiny-a", "qwen2-tiny-b")
POISON_FLOATS = [math.nan, math.inf, -math.inf, 1e-40, 5e-324]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", POISON_FLOATS)
def test_sampling_params_refuse_non_finite_and_denormal_numbers(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30, 1.5, True])
def test_sampling_params_refuse_seeds_outside_int64(seed):
    with pytest.raises(ValueError, match="^seed "):
        SamplingParams(temperature=1.0, seed=seed)


@pytest.mark.parametrize("field", ["ttft_s", "tbt_s"])
@pytest.mark.parametrize("value", POISON_FLOATS + [0.0, -1.0, 1e30, 1e-9])
def test_slo_refuses_values_no_scheduler_can_use(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SLO(**{field: value})


def test_tiny_temperatures_are_greedy_instead_of_overflowing():
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=0.1).greedy


@pytest.fixture(scope="module")
def paths(zoo_model):
    return {m: zoo_model(m) for m in MODELS}


def _engine(paths) -> Engine:
    slot = max(WeightLayout.from_dir(p).total_bytes for p in paths.values())
    kv = 8 * MiB
    engine = Engine(EngineConfig(budget_bytes=kv + 2 * (slot + 4096), kv_bytes=kv, num_slots=2,
                                 slab_bytes=96 * 1024 * 4, host_kv_bytes=8 * MiB))
    for name, path in paths.items():
        engine.register_model(name, path)
    return engine


def _innocents() -> list[GenerateRequest]:
    greedy = SamplingParams(max_tokens=14, ignore_eos=True)
    seeded = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    return [GenerateRequest(f"ok-{i}", MODELS[i % 2], (30 + i, 40, 50 + 3 * i), seeded if i == 3 else greedy)
            for i in range(6)]


def _run(engine: Engine, requests, poison=None) -> dict[str, dict]:
    """Run to the end; `poison(engine)` adds a bad request (after the innocents, same step)."""
    for r in requests:
        engine.add_request(r)
    if poison is not None:
        poison(engine)
    out: dict[str, dict] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for f in engine.step():
            o = out.setdefault(f.request_id, {"tokens": [], "text": "", "finish": None, "error": None})
            o["tokens"] += f.token_ids
            o["text"] += f.text
            o["finish"], o["error"] = f.finish_reason or o["finish"], f.error or o["error"]
    assert not engine.has_unfinished()
    return out


def _nan_temperature(engine: Engine) -> None:
    engine.add_request(GenerateRequest("poison", MODELS[0], (30, 40, 50), SamplingParams(max_tokens=14, temperature=0.7)))
    # as if validation had a gap (add_request checks again, so the value changes after it)
    object.__setattr__(engine.requests["poison"].sampling_params, "temperature", math.nan)


def _out_of_vocab_prompt(engine: Engine) -> None:
    engine.add_request(GenerateRequest("poison", MODELS[1], (31, 40, 53), SamplingParams(max_tokens=14)))
    engine.requests["poison"].prompt_token_ids[1] = 10**6   # the forward's embedding lookup raises


@pytest.mark.parametrize("poison", [_nan_temperature, _out_of_vocab_prompt], ids=["sampling", "forward"])
def test_a_poisoned_request_fails_alone_and_innocents_are_unchanged(paths, poison):
    undisturbed = _run(_engine(paths), _innocents())
    disturbed = _run(_engine(paths), _innocents(), poison)
    assert disturbed["poison"]["finish"] == FINISH_ERROR and disturbed["poison"]["error"]
    for r in _innocents():
        assert disturbed[r.request_id]["finish"] == "length", disturbed[r.request_id]
        assert disturbed[r.request_id]["tokens"] == undisturbed[r.request_id]["tokens"]
        assert disturbed[r.request_id]["text"] == undisturbed[r.request_id]["text"]


def test_a_step_no_request_explains_still_raises_for_fail_all(paths):
    engine = _engine(paths)
    for i in range(3):   # every request of the batch fails alone too: not one request's fault
        engine.add_request(GenerateRequest(f"bad-{i}", MODELS[0], (30, 40), SamplingParams(max_tokens=4)))
        engine.requests[f"bad-{i}"].prompt_token_ids[0] = 10**6
    with pytest.raises(ValueError, match="token ids"):
        engine.step()
    frames = engine.fail_all("device fault")
    assert {f.request_id for f in frames} == {"bad-0", "bad-1", "bad-2"} and not engine.has_unfinished()


def test_a_python_caller_cannot_poison_a_worker(ray_session, paths):
    """A DeviceWorker handle fed a NaN temperature directly (a request built around the
    constructor's checks; Ray unpickles it without running them): that request ends with an
    error frame naming the field; the other streams on the worker complete as undisturbed."""
    import asyncio

    import ray

    from actors.worker import DeviceWorker

    config = {"budget_bytes": 64 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
              "host_kv_bytes": 8 * MiB}
    actor = ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker).remote("w-poison", EngineConfig(**config), num_threads=1)
    try:
        ray.get([actor.register_model.remote(name, str(path)) for name, path in paths.items()])
        undisturbed = _run(_engine(paths), _innocents())
        poison = GenerateRequest("poison", MODELS[0], (30, 40, 50), SamplingParams(temperature=0.5))
        object.__setattr__(poison.sampling_params, "temperature", math.nan)

        async def collect(req: GenerateRequest) -> tuple[list[int], list[str]]:
            tokens, errors = [], []
            async for ref in actor.generate.remote(req):
                frame = await ref
                tokens += frame.token_ids
                errors += [frame.error] if frame.error else []
            return tokens, errors

        async def burst():
            return await asyncio.gather(*[collect(r) for r in _innocents()], collect(poison))

        *innocent, (poison_tokens, poison_errors) = asyncio.run(burst())
        assert not poison_tokens and len(poison_errors) == 1 and "temperature" in poison_errors[0], poison_errors
        assert innocent == [(undisturbed[r.request_id]["tokens"], []) for r in _innocents()]
    finally:
        ray.kill(actor)
