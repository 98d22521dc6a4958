"""Decode against the memory-bandwidth limit (`decode_vs_bw_limit`), for a GPU run.

At batch 1 a decode step must read every weight once and the sequence's KV so far, and
does little arithmetic per byte, so no engine can step faster than

    limit = (weight bytes read + KV bytes read) / memory bandwidth

The bandwidth is measured here, not taken from a datasheet: the median of device-to-
device copies of a 1 GiB buffer (each reads and writes it: 2 GiB of traffic). A step
reads all weights but the embedding table, of which only its token's row (the lm_head
reads the table when embeddings are tied), and per layer the K and V of every cached
position. Step times are the engine's own decode turns (`Engine.timeline`) of one
greedy request; `decode_vs_bw_limit` = median step / limit (1.0 would be perfect).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from load_tests.bench.common import engine_for, greedy_requests, make_prompts, run_to_completion, sync


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second moved by `dst.copy_(src)` on `device` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def measure_bw_limit(path: Path, *, device: torch.device, host_cache, name: str, kernels: str,
                     prompt_tokens: int = 16, new_tokens: int = 64) -> dict:
    from actors.layer_kernels import EMBED

    prompts = make_prompts(1, prompt_tokens, seed=3)
    engine = engine_for({name: path}, num_slots=2, tokens_per_model=len(prompts[0]) + new_tokens,
                        device=device, dtype=None, host_cache=host_cache, kernels=kernels)
    run_to_completion(engine, greedy_requests(name, prompts, 8, "warm"))   # graphs captured, weights resident
    first = len(engine.timeline)
    run_to_completion(engine, greedy_requests(name, prompts, new_tokens, "bw"))
    steps = [end - start for _, start, end, is_prefill in list(engine.timeline)[first:] if not is_prefill]
    m = engine.models[name]
    spec, layout = m.spec, m.layout
    embed = next(e for e in layout.entries if e.name == EMBED)
    weight_read = layout.total_bytes - (0 if spec.tie_word_embeddings else embed.nbytes - embed.nbytes // spec.vocab_size)
    kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * m.dtype.itemsize
    mean_context = len(prompts[0]) + new_tokens / 2
    bandwidth = copy_bandwidth(device)
    limit = (weight_read + kv_per_token * mean_context) / bandwidth
    step = statistics.median(steps)
    graphs = getattr(m.runner, "graphs", None)
    return {
        "decode_vs_bw_limit": step / limit,
        "bw_decode_step_s": step,
        "bw_limit_step_s": limit,
        "bw_copy_bytes_s": bandwidth,
        "bw_weight_bytes_read": weight_read,
        "bw_kv_bytes_read": kv_per_token * mean_context,
        "bw_decode_steps": len(steps),
        "bw_cuda_graph_replays": graphs.num_replays if graphs is not None else 0,
        "bw_setup": "batch 1, greedy, median engine decode turn; bandwidth: median 1 GiB device copy, "
                    "read + write counted; KV at the mean context of the run",
    }
