"""The engine against the oracle: greedy output equals transformers' generate(), token for
token, alone, with 8 models interleaved in a budget that holds 2 models' weights, and with
KV preemption forced by a tiny pool. Seeded sampling is reproducible across interleavings."""
from __future__ import annotations

import random

import pytest
import torch

from actors.engine import Engine, EngineConfig
from actors.weight_layout import WeightLayout
from actors.zoo.zoo import TINY_MODELS
from scheduler.messages import GenerateRequest
from scheduler.policy import SchedulerConfig
from scheduler.sampling_params import SamplingParams
from tests.greedy_reference import hf_greedy

MiB = 1 << 20
ARCH_MODELS = ["llama-tiny-a", "qwen2-tiny-a", "mistral-tiny-a"]
EIGHT_MODELS = list(TINY_MODELS[:8])
NUM_PROMPTS = 20
MAX_NEW = 12


def _prompts(seed: int, n: int = NUM_PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    # mixed lengths, several crossing 16-token block boundaries; ids avoid the special tokens
    return [[rng.randrange(8, 2000) for _ in range(rng.choice([1, 3, 7, 15, 16, 17, 31, 33, 40]))]
            for _ in range(n)]


def _engine(paths: dict, num_slots: int, kv_bytes: int = 16 * MiB, slab_bytes: int = 256 * 1024,
            host_kv_bytes: int = 16 * MiB, policy: str = "token", dtype: str | None = None, **scheduler) -> Engine:
    as_dtype = getattr(torch, dtype) if dtype else None
    slot = max(WeightLayout.from_dir(p, dtype=as_dtype).total_bytes for p in paths.values())
    config = EngineConfig(budget_bytes=kv_bytes + num_slots * (slot + 4096), kv_bytes=kv_bytes,
                          num_slots=num_slots, slab_bytes=slab_bytes, host_kv_bytes=host_kv_bytes,
                          policy=policy, dtype=dtype, scheduler=SchedulerConfig(**scheduler))
    engine = Engine(config)
    for name, path in paths.items():
        engine.register_model(name, path)
    return engine


def _run(engine: Engine, requests: list[GenerateRequest], max_steps: int = 20000) -> dict[str, dict]:
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: {"tokens": [], "text": "", "finish": None} for r in requests}
    steps = 0
    while engine.has_unfinished():
        for frame in engine.step():
            o = out.setdefault(frame.request_id, {"tokens": [], "text": "", "finish": None})
            o["tokens"] += frame.token_ids
            o["text"] += frame.text
            if frame.finish_reason:
                o["finish"] = frame.finish_reason
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return out


def _greedy_requests(models: list[str], seed: int, max_new: int = MAX_NEW) -> list[GenerateRequest]:
    # EOS ends a request in both the engine and generate(), so outputs compare whole
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    reqs = []
    for i, prompt in enumerate(_prompts(seed, NUM_PROMPTS * len(models))):
        model = models[i % len(models)]
        reqs.append(GenerateRequest(f"r{i}", model, tuple(prompt), params))
    return reqs


@pytest.mark.parametrize("policy", ["token", "request"])
def test_multi_step_runs_give_the_same_tokens_as_one_step_at_a_time(zoo_model, policy):
    """Runs of up to 8 decode steps per schedule call (the default) against max_decode_steps=1:
    the same tokens, texts and finish reasons, in far fewer schedule calls (turns and prefills
    may fall on other steps: a run is planned at its start)."""
    paths = {m: zoo_model(m) for m in ARCH_MODELS}
    results = {}
    for most in (1, 8):
        engine = _engine(paths, num_slots=3, policy=policy, max_decode_steps=most)   # all resident: 4-step turns
        calls = [0]
        schedule = engine.policy.schedule

        def counted(now, schedule=schedule):
            calls[0] += 1
            return schedule(now)

        engine.policy.schedule = counted
        reqs = _greedy_requests(ARCH_MODELS, seed=5, max_new=40)[:18]
        results[most] = (_run(engine, reqs), engine.num_steps, calls[0])
    (one, one_steps, one_calls), (multi, multi_steps, multi_calls) = results[1], results[8]
    assert multi == one
    assert multi_calls < 0.7 * one_calls and abs(multi_steps - one_steps) <= 0.1 * one_steps


@pytest.mark.parametrize("model", ARCH_MODELS)
def test_one_model_alone_equals_hf_generate(zoo_model, model):
    path = zoo_model(model)
    engine = _engine({model: path}, num_slots=1)
    reqs = _greedy_requests([model], seed=1)
    out = _run(engine, reqs)
    for r in reqs:
        assert out[r.request_id]["tokens"] == hf_greedy(path, list(r.prompt_token_ids), MAX_NEW), r.request_id
        assert out[r.request_id]["finish"] in ("length", "stop")


def test_eight_models_interleaved_with_budget_for_two(zoo_model):
    paths = {m: zoo_model(m) for m in EIGHT_MODELS}
    engine = _engine(paths, num_slots=2)
    reqs = _greedy_requests(EIGHT_MODELS, seed=2)
    reqs = reqs[: 8 * 6]   # 6 prompts per model keeps the test short; mixed lengths still
    out = _run(engine, reqs)
    for r in reqs:
        assert out[r.request_id]["tokens"] == hf_greedy(paths[r.model], list(r.prompt_token_ids), MAX_NEW), \
            (r.request_id, r.model)
    swaps = engine.slots.stats()["swaps_per_model"]
    assert len(swaps) == 8 and sum(swaps.values()) > 8, "every model was swapped in, some more than once"


def test_kv_preemption_by_a_tiny_pool_keeps_output_exact(zoo_model):
    """The policy's SchedulerOutputs to the engine and the engine's StepResults back to the
    policy, both real: each step's result has a token for every request that makes one, KV
    swapped out (device -> host) comes back in from the host blocks it went to, and the
    output still equals generate()."""
    model = "llama-tiny-b"
    path = zoo_model(model)
    from actors.model_spec import ModelSpec

    shape = ModelSpec.from_dir(path).kv_shape
    slab = shape.block_bytes * 4                 # 4 blocks per slab
    engine = _engine({model: path}, num_slots=1, kv_bytes=slab * 6, slab_bytes=slab, host_kv_bytes=slab * 64)
    steps = []
    update = engine.policy.update

    def recorded(output, result, update=update):
        steps.append((output, result))
        return update(output, result)

    engine.policy.update = recorded
    reqs = _greedy_requests([model], seed=3, max_new=20)
    out = _run(engine, reqs)
    assert engine.policy.num_preemptions > 0, "the pool was meant to be too small for all requests at once"
    for r in reqs:
        assert out[r.request_id]["tokens"] == hf_greedy(path, list(r.prompt_token_ids), 20), r.request_id
    host_of, previous = {}, None   # request id -> the host blocks its KV was swapped out to
    for output, result in steps:
        assert set(output.num_scheduled_tokens) == {r.request_id for r in output.requests}
        assert {r.request_id for r in output.requests} - output.partial <= set(result.sampled)
        assert result.step_time_s > 0
        if output is previous:   # the next step of a multi-step run: its copies were done before its first
            continue
        previous = output
        for copy in output.swap_in:
            assert copy.src == host_of.pop(copy.request_id)
        host_of.update((copy.request_id, copy.dst) for copy in output.swap_out)
    assert any(output.swap_in for output, _ in steps)


def test_seeded_sampling_is_reproducible_across_interleavings(zoo_model):
    models = ["llama-tiny-a", "qwen2-tiny-b", "mistral-tiny-a"]
    paths = {m: zoo_model(m) for m in models}
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompts = _prompts(7, 6)

    def run(order: list[int], others: int) -> dict:
        engine = _engine(paths, num_slots=2)
        reqs = [GenerateRequest(f"s{i}", models[i % 3], tuple(prompts[i]), params) for i in order]
        noise = SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)
        reqs += [GenerateRequest(f"n{j}", models[j % 3], tuple(prompts[j % 6]), noise) for j in range(others)]
        out = _run(engine, reqs)
        return {k: v["tokens"] for k, v in out.items() if k.startswith("s")}

    first = run(list(range(6)), others=0)
    second = run(list(reversed(range(6))), others=5)
    assert first == second
    assert len({tuple(v) for v in first.values()}) > 1


@pytest.mark.parametrize("smooth", [False, True])
def test_chunked_prefill_equals_hf_generate_and_keeps_seeded_streams(zoo_model, smooth):
    """Every prompt prefilled in chunks of 5 tokens (the policy's chunk budget forced; a decode
    turn between chunks when another model decodes): greedy output still equals generate(),
    no token comes out of a chunk, and a seeded stream draws what it draws unchunked."""
    models = ["llama-tiny-a", "qwen2-tiny-b"]
    paths = {m: zoo_model(m) for m in models}
    greedy = [r for r in _greedy_requests(models, seed=9) if len(r.prompt_token_ids) > 5][:12]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=77, ignore_eos=True)
    seeded = [GenerateRequest(f"s{i}", models[i % 2], tuple(p), params) for i, p in enumerate(_prompts(11, 4))]
    whole = _run(_engine(paths, num_slots=2), list(seeded))
    engine = _engine(paths, num_slots=2, smooth_streams=smooth)
    engine.policy.prefill.chunk_tokens = lambda model, tokens, limit_s=None: 5 if tokens > 5 else None
    out = _run(engine, greedy + seeded)
    for r in greedy:
        assert out[r.request_id]["tokens"] == hf_greedy(paths[r.model], list(r.prompt_token_ids), MAX_NEW), \
            r.request_id
    assert {k: out[k]["tokens"] for k in whole} == {k: v["tokens"] for k, v in whole.items()}
    # a prompt of n tokens took ceil(n / 5) prefill steps: more steps than requests
    assert engine.num_steps > sum(-(-len(r.prompt_token_ids) // 5) for r in greedy)


def test_stop_strings_and_eos_end_requests(zoo_model):
    model = "llama-tiny-a"
    path = zoo_model(model)
    engine = _engine({model: path}, num_slots=1)
    prompt = tuple(_prompts(11, 1)[0])
    full = _run(engine, [GenerateRequest("full", model, prompt, SamplingParams(max_tokens=30, ignore_eos=True))])
    text = full["full"]["text"]
    assert len(text) > 4
    stop = text[2:4]
    out = _run(engine, [GenerateRequest("cut", model, prompt, SamplingParams(max_tokens=30, stop=(stop,),
                                                                                 ignore_eos=True))])
    assert out["cut"]["finish"] == "stop"
    assert out["cut"]["text"] == text[: text.index(stop)]


def test_bad_input_is_refused_with_clear_errors(zoo_model):
    model = "llama-tiny-a"
    path = zoo_model(model)
    engine = _engine({model: path}, num_slots=1)
    with pytest.raises(ValueError, match="unknown model 'nope'.*llama-tiny-a"):
        engine.add_request(GenerateRequest("a", "nope", (5,)))
    max_ctx = engine.models[model].spec.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add_request(GenerateRequest("b", model, tuple([5] * max_ctx)))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished()


def test_model_too_big_for_the_budget_is_refused_with_numbers(zoo_model):
    small = zoo_model("qwen2-tiny-c")
    big = zoo_model("llama-10m")
    engine = _engine({"small": small}, num_slots=2)
    with pytest.raises(ValueError, match=r"needs .*MB of weights but a slot holds"):
        engine.register_model("big", big)
    assert "big" not in engine.models


def test_unregister_waits_for_live_requests_and_reregister_is_idempotent(zoo_model):
    model = "llama-tiny-a"
    path = zoo_model(model)
    engine = _engine({model: path}, num_slots=1)
    assert engine.register_model(model, path).name == model     # same checkpoint again: no-op
    engine.add_request(GenerateRequest("live", model, (5, 6), SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="still has 1 unfinished"):
        engine.unregister_model(model)
    _run(engine, [])
    engine.unregister_model(model)
    assert model not in engine.models


def test_four_models_with_a_moe_among_them_switched_token_by_token_stay_exact(zoo_model):
    """A burst over a sparse MoE and three dense models, two slots, token-level switching:
    every request's greedy output equals generate()."""
    models = ["mixtral-tiny-a", "llama-tiny-b", "qwen2-tiny-a", "mistral-tiny-a"]
    paths = {m: zoo_model(m) for m in models}
    engine = _engine(paths, num_slots=2, policy="token")
    reqs = _greedy_requests(models, seed=11)[: 4 * 5]
    out = _run(engine, reqs)
    for r in reqs:
        assert out[r.request_id]["tokens"] == hf_greedy(paths[r.model], list(r.prompt_token_ids), MAX_NEW), \
            (r.request_id, r.model)
    assert engine.slots.stats()["swaps_per_model"]["mixtral-tiny-a"] >= 2, "the MoE was swapped out and back in"


def test_a_moe_slot_must_hold_every_expert_not_only_the_active_ones(zoo_model):
    from actors.model_spec import ModelSpec

    path = zoo_model("mixtral-tiny-a")
    spec = ModelSpec.from_dir(path)
    full = WeightLayout.from_dir(path).total_bytes
    active = spec.num_active_params * spec.dtype_bytes
    # 2 of 4 experts per token: each of the 2 layers leaves 2 experts (gate, up, down) unread
    assert spec.weight_bytes - active == 2 * 2 * 3 * spec.hidden_size * spec.moe.intermediate_size * 4
    kv = 16 * MiB
    small = Engine(EngineConfig(budget_bytes=kv + active + 8192, kv_bytes=kv, num_slots=1, slab_bytes=256 * 1024,
                                host_kv_bytes=0))
    with pytest.raises(ValueError, match=r"needs .*MB of weights but a slot holds"):
        small.register_model("moe", path)
    fits = Engine(EngineConfig(budget_bytes=kv + full + 8192, kv_bytes=kv, num_slots=1, slab_bytes=256 * 1024,
                               host_kv_bytes=0))
    fits.register_model("moe", path)
    assert "moe" in fits.models


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict:
    from family_checkpoints import gemma3, phi3, qwen3

    return {"qwen3": qwen3(tmp_path_factory.mktemp("qwen3"), dtype=torch.bfloat16, max_shard_size="100KB"),
            "gemma3": gemma3(tmp_path_factory.mktemp("gemma3")),
            "phi3": phi3(tmp_path_factory.mktemp("phi3"), dtype=torch.float16)}


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_new_families_taking_turns_in_two_slots_equal_hf_generate(family_paths, kernels):
    """Qwen3 (bf16, sharded), Gemma 3 and Phi-3 (fp16) in one engine with two weight slots and one
    KV pool (head dims 32, 32, 16; 3, 4 and 2 layers), run in float32 as the oracle loads them:
    every greedy output equals generate(), on the reference and the fast path. Prompts up to 40
    tokens plus 12 new pass Gemma's window of 8 and Phi-3's pretraining length of 32."""
    from actors.kernel_path import KernelPath

    layouts = [KernelPath(kernels, "cpu").weight_layout(p, torch.float32) for p in family_paths.values()]
    slot, kv = max(layout.total_bytes for layout in layouts), 16 * MiB
    engine = Engine(EngineConfig(budget_bytes=kv + 2 * (slot + 4096), kv_bytes=kv, num_slots=2, slab_bytes=256 * 1024,
                                 host_kv_bytes=16 * MiB, dtype="float32", kernels=kernels))
    for name, path in family_paths.items():
        engine.register_model(name, path)
    reqs = _greedy_requests(list(family_paths), seed=7)[:3 * 8]
    out = _run(engine, reqs)
    for r in reqs:
        assert out[r.request_id]["tokens"] == hf_greedy(family_paths[r.model], list(r.prompt_token_ids), MAX_NEW), \
            (r.request_id, r.model, len(r.prompt_token_ids))
    assert sum(engine.slots.stats()["swaps_per_model"].values()) > 3, "three models took turns in two slots"


@pytest.mark.slow
def test_a_four_family_mix_under_bursts_switches_token_by_token_and_stays_exact(family_paths, zoo_model, tmp_path):
    """Qwen3 (bf16, sharded), Qwen3-MoE, Gemma 3 and Llama in one engine with two weight slots
    and one KV pool, token-level policy, run in float32 as the oracle loads them. Two bursts
    (16 requests at once, then 8 more while those run): every greedy output equals generate(),
    and the models take turns token by token: each model's requests are paused mid-output for
    another model's tokens and resumed, instead of one model running its requests to the end."""
    from family_checkpoints import qwen3_moe

    paths = {"qwen3": family_paths["qwen3"], "qwen3-moe": qwen3_moe(tmp_path / "qwen3-moe"),
             "gemma3": family_paths["gemma3"], "llama": zoo_model("llama-tiny-a")}
    engine = _engine(paths, num_slots=2, policy="token", dtype="float32")
    reqs = _greedy_requests(list(paths), seed=13)[:24]
    model_of = {r.request_id: r.model for r in reqs}
    for r in reqs[:16]:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    calls: list[tuple[str, set[str]]] = []   # per step() call: its model, the requests it gave tokens
    while engine.has_unfinished():
        frames = [f for f in engine.step() if f.token_ids]
        for f in frames:
            out[f.request_id] += f.token_ids
        if frames:
            calls.append((model_of[frames[0].request_id], {f.request_id for f in frames}))
        if len(calls) == 6:   # the second burst arrives while the first is in flight
            for r in reqs[16:]:
                engine.add_request(r)
        assert len(calls) < 5000, "engine did not finish"
    for r in reqs:
        assert out[r.request_id] == hf_greedy(paths[r.model], list(r.prompt_token_ids), MAX_NEW), \
            (r.request_id, r.model, len(r.prompt_token_ids))

    def paused_and_resumed(request_id: str) -> bool:   # another model's tokens came between two of its own
        mine = [i for i, (_, ids) in enumerate(calls) if request_id in ids]
        return any(model != model_of[request_id] for model, _ in calls[mine[0]:mine[-1]])

    paused = {m: [r.request_id for r in reqs if r.model == m and paused_and_resumed(r.request_id)] for m in paths}
    assert all(paused.values()), f"a model ran its requests to the end without a switch: {paused}"
    turns = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
    assert turns >= 2 * len(paths), f"only {turns} switches between models for {len(reqs)} requests"
