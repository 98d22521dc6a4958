"""A model split over a tensor-parallel group of 2 (actors/tp_group.py): one process per
rank, each a virtual device holding its part of the weights and of the KV cache, summing
over gloo after attention and the MLP. Greedy output equals transformers' `generate()` of
the whole checkpoint, token for token:

- the model runner alone, in two spawned processes, on a zoo model (4 heads, 4 KV heads) and
  on a random Qwen3 checkpoint whose 4 query heads share 2 KV heads (each rank: 2 query
  heads, 1 KV head);
- served: a leader engine (rank 0, its policy deciding every step) and a TPMember actor
  (rank 1) that follows each step through Ray actor calls, under a burst of 16 requests in
  a KV pool small enough that requests are preempted and swapped to host and back.
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
from actors.tp_member import TPMember
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


def _leader_actor(ray):
    @ray.remote(num_cpus=0)
    class Leader:
        """Rank 0's process: an engine whose policy schedules the group's model (self-contained:
        the test module is not importable in Ray's workers)."""

        def __init__(self, config, address):
            from actors.engine import Engine
            from actors.tensor_parallel import TPShard
            from actors.tp_group import TPGroup

            self.group = TPGroup(TPShard(0, 2), address)
            self.engine = Engine(config)

        def register_model(self, name, path, members):
            from actors.tp_member import TPMembers

            return self.engine.register_model(name, path, group=self.group, members=TPMembers(members))

        def generate(self, requests):
            for r in requests:
                self.engine.add_request(r)
            tokens = {r.request_id: [] for r in requests}
            errors = []
            while self.engine.has_unfinished():
                for frame in self.engine.step():
                    tokens[frame.request_id] += frame.token_ids
                    if frame.error:
                        errors.append(frame.error)
            return tokens, errors, self.engine.policy.num_preemptions

        def close(self):
            self.group.close()

    return Leader


BURST = 16
BURST_MAX_NEW = 24


@pytest.mark.timeout(240)
def test_a_tp2_group_serves_a_burst_exactly(ray_session):
    """16 requests at once on llama-tiny-b (8 query heads over 2 KV heads) served by a group of
    2: the pool holds 16 of a rank's KV blocks, fewer than the burst needs, so the leader's
    policy preempts requests (their KV swapped to host) on both ranks alike; every output
    equals generate()."""
    ray = ray_session
    path = ensure_model("llama-tiny-b")
    rank_spec = TPShard(0, 2).spec(ModelSpec.from_dir(path))
    slab = rank_spec.kv_shape.block_bytes * 4
    weights = KernelPath("reference", "cpu").weight_layout(path, torch.float32, TPShard(0, 2)).total_bytes
    config = EngineConfig(budget_bytes=slab * 4 + weights + 4096, kv_bytes=slab * 4, num_slots=1, slab_bytes=slab,
                          host_kv_bytes=slab * 64, kernels="reference", detokenize=False)
    address = free_address()
    member = ray.remote(num_cpus=0)(TPMember).remote(config, TPShard(1, 2), address)
    leader = _leader_actor(ray).remote(config, address)
    try:
        ray.get(member.register_model.remote("big", str(path)), timeout=120)
        ray.get(leader.register_model.remote("big", str(path), [member]), timeout=120)
        rng = random.Random(7)
        prompts = [[rng.randrange(8, 2000) for _ in range(rng.choice([7, 15, 17, 31, 33, 40]))] for _ in range(BURST)]
        requests = [GenerateRequest(f"r{i}", "big", tuple(p), SamplingParams(max_tokens=BURST_MAX_NEW, temperature=0.0))
                    for i, p in enumerate(prompts)]
        tokens, errors, preemptions = ray.get(leader.generate.remote(requests), timeout=180)
    finally:
        for actor in (leader, member):
            ray.kill(actor)
    assert not errors
    assert preemptions > 0, "the pool was meant to be too small for the whole burst"
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(path, p, BURST_MAX_NEW), f"r{i}"
