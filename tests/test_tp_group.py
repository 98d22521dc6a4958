"""A model split over a tensor-parallel group of 2 (actors/tp_group.py): one spawned process
per rank, each a virtual device holding its part of the weights and of the KV cache, summing
over gloo after attention and the MLP. Greedy output equals transformers' `generate()` of
the whole checkpoint, token for token, on a zoo model (4 heads, 4 KV heads) and on a random
Qwen3 checkpoint whose 4 query heads share 2 KV heads (each rank: 2 query heads, 1 KV head).
"""
from __future__ import annotations

import multiprocessing
import queue

import pytest
from family_checkpoints import qwen3

from actors.tp_group import free_address
from actors.zoo.zoo import ensure_model
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
