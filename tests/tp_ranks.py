"""One tensor-parallel rank's weights and greedy decode, the way a rank's process runs them:
the rank's layout (KernelPath.weight_layout with a TPShard) filled into a host cache, its
model runner summing over the group after attention and the MLP (actors/tp_group.py).
Shared by the sharding tests and the gloo tests, whose spawned rank processes import it."""
from __future__ import annotations

import random
import traceback

import torch

from actors.host_cache import HostWeightCache
from actors.kernel_path import KernelPath
from actors.model_runner import ModelRunner, SeqChunk
from actors.model_spec import ModelSpec
from actors.tensor_parallel import TPShard
from actors.weight_layout import WeightLayout
from scheduler.kv_blocks import BLOCK_SIZE


def rank_params(layout: WeightLayout, cache: HostWeightCache, name: str) -> dict[str, torch.Tensor]:
    """name -> a view of the layout's tensor in the host cache (plain, unpacked layouts only)."""
    cache.add(name, layout)
    flat = cache.flat(name)
    return {e.name: flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout.entries}


def greedy(runner: ModelRunner, params: dict, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy decode of every prompt, batched: one prefill forward, then one decode forward a
    step for the live sequences, over scattered blocks of a paged pool; a sequence ends at EOS."""
    spec = runner.spec
    num_blocks = sum(-(-(len(p) + max_new) // BLOCK_SIZE) for p in prompts)
    kv = torch.zeros(1, num_blocks, spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    tables = []
    for p in prompts:
        n = -(-(len(p) + max_new) // BLOCK_SIZE)
        tables.append(free[:n])
        free = free[n:]
    eos = set(spec.eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = {i: SeqChunk(p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))}
    while chunks:
        live = sorted(chunks)
        tokens = runner.forward(params, [chunks[i] for i in live], kv).argmax(-1).tolist()
        for i, token in zip(live, tokens):
            outputs[i].append(token)
            done = token in eos or len(outputs[i]) == max_new
            start = chunks[i].start_pos + len(chunks[i].token_ids)
            chunks.pop(i) if done else chunks.__setitem__(i, SeqChunk([token], start, tables[i]))
    return outputs


def run_rank(rank: int, size: int, address: str, path: str, shm_dir: str, prompts: list[list[int]], max_new: int,
             results) -> None:
    """A spawned rank's whole life: join the group, load its part, decode; (rank, tokens) or
    (rank, traceback) into `results`."""
    from actors.tp_group import TPGroup

    torch.set_num_threads(1)
    try:
        shard = TPShard(rank, size)
        group = TPGroup(shard, address)
        cache = HostWeightCache(shm_dir=shm_dir, pin=False)
        try:
            layout = KernelPath("reference", "cpu").weight_layout(path, torch.float32, shard)
            runner = ModelRunner(shard.spec(ModelSpec.from_dir(path)), "cpu", all_reduce=group.all_reduce)
            results.put((rank, greedy(runner, rank_params(layout, cache, f"rank{rank}"), prompts, max_new)))
        finally:
            cache.close()
            group.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))
