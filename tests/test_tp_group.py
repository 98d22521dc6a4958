"""A model split over a tensor-parallel group of 2 (actors/tp_group.py): one process per
rank, each a virtual device holding its part of the weights and of the KV cache, summing
over gloo after attention and the MLP. Greedy output equals transformers' `generate()` of
the whole checkpoint, token for token:

- the model runner alone, in two spawned processes, on a zoo model (4 heads, 4 KV heads) and
  on a random Qwen3 checkpoint whose 4 query heads share 2 KV heads (each rank: 2 query
  heads, 1 KV head);
- served by two DeviceWorkers: the leader (rank 0, its policy deciding every step) and a
  member (rank 1) that follows each step through Ray actor calls, under a burst of 16
  requests in a KV pool small enough that requests are preempted and swapped to host and back;
- beside two single-device models, one on each of the group's devices, under two bursts:
  each device switches between the group's turns and its own model's, token by token.
"""
from __future__ import annotations

import multiprocessing
import queue
import random

import pytest
import torch
from family_checkpoints import qwen3

from actors.engine import EngineConfig
from actors.kernel_path import KernelPath
from actors.model_spec import ModelSpec
from actors.tensor_parallel import TPShard
from actors.tp_group import free_address
from actors.zoo.zoo import ensure_model
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from tests.greedy_reference import hf_greedy
from tests.tp_ranks import run_rank

MAX_NEW = 10
PROMPTS = [[5, 9, 13], list(range(40, 57)), [7] * 30 + [200, 300], [101, 7, 88, 9, 64, 22, 17]]
RANK_WAIT_S = 90.0


def group_greedy(path, shm_dir, size: int = 2) -> list[list[int]]:
    """Rank 0's greedy tokens of PROMPTS, with every rank in its own process."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = free_address()
    ranks = [ctx.Process(target=run_rank, args=(r, size, address, str(path), str(shm_dir), PROMPTS, MAX_NEW, results))
             for r in range(size)]
    for p in ranks:
        p.start()
    try:
        answers = dict(results.get(timeout=RANK_WAIT_S) for _ in ranks)
    except queue.Empty:
        pytest.fail(f"the ranks did not answer within {RANK_WAIT_S} s")
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, answer in answers.items():
        assert not isinstance(answer, str), f"rank {rank} failed:\n{answer}"
    assert answers[0] == answers[1], "the ranks sampled different tokens"
    return answers[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("checkpoint", ["llama-tiny-a", "qwen3-grouped-kv"])
def test_tp2_greedy_equals_generate(checkpoint, tmp_path):
    path = ensure_model(checkpoint) if checkpoint.startswith("llama") else qwen3(tmp_path / "qwen3")
    expected = [hf_greedy(path, p, MAX_NEW) for p in PROMPTS]
    assert group_greedy(path, tmp_path) == expected


BURST = 16
BURST_MAX_NEW = 24
SERVE_WAIT_S = 180.0


def _config(path, extra_slot_paths=(), kv_blocks: int = 16) -> EngineConfig:
    """A device's budget: one slot per model it holds, and a pool of `kv_blocks` of a rank's
    KV blocks (4 to a slab)."""
    rank_spec = TPShard(0, 2).spec(ModelSpec.from_dir(path))
    slab = rank_spec.kv_shape.block_bytes * 4
    kernels = KernelPath("reference", "cpu")
    slot = max([kernels.weight_layout(path, torch.float32, TPShard(0, 2)).total_bytes] +
               [kernels.weight_layout(p, torch.float32).total_bytes for p in extra_slot_paths]) + 4096
    num_slots = 1 + len(extra_slot_paths)
    kv_bytes = slab * (kv_blocks // 4)
    return EngineConfig(budget_bytes=kv_bytes + num_slots * slot, kv_bytes=kv_bytes, num_slots=num_slots,
                        slab_bytes=slab, host_kv_bytes=slab * 64, kernels="reference", detokenize=False)


def _group(ray, config: EngineConfig, name: str, path, prefix: str = "tp") -> list:
    """Two DeviceWorkers (virtual devices) that hold `name` split between them; [leader, member],
    named prefix0 and prefix1."""
    from actors.worker import DeviceWorker

    workers = [ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker).remote(f"{prefix}{r}", config, num_threads=1)
               for r in range(2)]
    ray.get([w.ready.remote() for w in workers])
    address = free_address()
    ray.get([w.join_tp_group.remote(TPShard(r, 2), address) for r, w in enumerate(workers)], timeout=120)
    ray.get(workers[1].register_tp_model.remote(name, str(path)), timeout=120)
    ray.get(workers[0].register_tp_model.remote(name, str(path), [workers[1]]), timeout=120)
    return workers


def _serve(ray, worker_requests: list[tuple]) -> dict[str, list[int]]:
    """Every (worker, request) streamed at once; request id -> its tokens (an error frame fails)."""
    import asyncio

    async def collect(worker, request):
        tokens = []
        async for ref in worker.generate.remote(request):
            frame = await ref
            assert frame.error is None, frame.error
            tokens += frame.token_ids
        return request.request_id, tokens

    async def main():
        return dict(await asyncio.wait_for(asyncio.gather(*[collect(w, r) for w, r in worker_requests]),
                                           SERVE_WAIT_S))
    return asyncio.run(main())


def _requests(model: str, seed: int, n: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"{model}-{i}", model,
                            tuple(rng.randrange(8, 2000) for _ in range(rng.choice([7, 15, 17, 31, 33, 40]))),
                            SamplingParams(max_tokens=BURST_MAX_NEW, temperature=0.0)) for i in range(n)]


def _expect(path, requests) -> dict[str, list[int]]:
    return {r.request_id: hf_greedy(path, list(r.prompt_token_ids), BURST_MAX_NEW) for r in requests}


@pytest.mark.timeout(240)
def test_a_tp2_group_serves_a_burst_exactly(ray_session):
    """16 requests at once on llama-tiny-b (8 query heads over 2 KV heads) served by a group of
    2 DeviceWorkers: the pool holds 16 of a rank's KV blocks, fewer than the burst needs, so the
    leader's policy preempts requests (their KV swapped to host) on both ranks alike; every
    output equals generate()."""
    ray = ray_session
    path = ensure_model("llama-tiny-b")
    workers = _group(ray, _config(path), "big", path)
    try:
        requests = _requests("big", 7, BURST)
        tokens = _serve(ray, [(workers[0], r) for r in requests])
        stats = ray.get(workers[0].stats.remote())
    finally:
        for w in workers:
            ray.kill(w)
    assert stats.engine.num_preemptions > 0, "the pool was meant to be too small for the whole burst"
    assert tokens == _expect(path, requests)


def _runs(timeline) -> list[str]:
    """The models of a device's timeline, one entry per run of consecutive steps of one model."""
    runs: list[str] = []
    for record in sorted(timeline, key=lambda r: r.start):
        if not runs or runs[-1] != record.model:
            runs.append(record.model)
    return runs


@pytest.mark.timeout(300)
def test_a_group_and_two_single_device_models_take_turns_token_by_token(ray_session):
    """A TP-2 model (llama-tiny-b, over both devices) beside llama-tiny-a on the leader's device
    and qwen2-tiny-a on the member's, one weight slot each: two bursts of all three at once.
    Every output equals generate(); each device's timeline shows the group's turns between its
    own model's, and on each device the group's weights were swapped in again after the
    device's own model had its slot (its members swap in with the leader)."""
    ray = ray_session
    big, mine, theirs = (ensure_model(m) for m in ("llama-tiny-b", "llama-tiny-a", "qwen2-tiny-a"))
    block = max(ModelSpec.from_dir(p).kv_shape.block_bytes for p in (mine, theirs))
    kernels = KernelPath("reference", "cpu")
    slot = max(kernels.weight_layout(p, torch.float32).total_bytes for p in (big, mine, theirs)) + 4096
    slab = block * 4
    config = EngineConfig(budget_bytes=slab * 8 + slot, kv_bytes=slab * 8, num_slots=1, slab_bytes=slab,
                          host_kv_bytes=slab * 64, kernels="reference", detokenize=False)
    leader, member = _group(ray, config, "big", big)
    try:
        ray.get([leader.register_model.remote("mine", str(mine)), member.register_model.remote("theirs", str(theirs))])
        first = [(leader, r) for r in _requests("big", 1, 6)] + [(leader, r) for r in _requests("mine", 2, 4)] + \
            [(member, r) for r in _requests("theirs", 3, 4)]
        second = [(leader, r) for r in _requests("big", 4, 6)] + [(member, r) for r in _requests("theirs", 5, 4)]
        second = [(w, GenerateRequest(f"{r.request_id}-b", r.model, r.prompt_token_ids, r.sampling_params))
                  for w, r in second]
        tokens = _serve(ray, first)
        tokens |= _serve(ray, second)
        timelines = ray.get([leader.timeline.remote(), member.timeline.remote()])
        swaps = [s.engine.weights["swaps_per_model"] for s in ray.get([leader.stats.remote(), member.stats.remote()])]
    finally:
        for w in (leader, member):
            ray.kill(w)
    paths = {"big": big, "mine": mine, "theirs": theirs}
    expected = {}
    for _, r in first + second:
        expected[r.request_id] = hf_greedy(paths[r.model], list(r.prompt_token_ids), BURST_MAX_NEW)
    assert tokens == expected
    for device, own, timeline, swapped in zip(("leader", "member"), ("mine", "theirs"), timelines, swaps):
        runs = _runs(timeline)
        assert set(runs) == {"big", own}, device
        assert sum(1 for a, b in zip(runs, runs[1:]) if (a, b) == ("big", own)) >= 2, (device, runs)
        assert swapped["big"] >= 2 and swapped[own] >= 2, (device, swapped)
