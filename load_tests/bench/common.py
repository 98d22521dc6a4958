"""Shared pieces of the benchmarks: timing, machine info, prompts, engines sized to a job."""
from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

MiB = 1 << 20
SLAB_BYTES = 4 * MiB


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("no measurements to take the median of")
    return float(statistics.median(values))


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a wall-clock interval covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def torch_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def make_prompts(n: int, mean_len: int, seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    """n prompts of mean_len +- 4 tokens; ids avoid the zoo's special tokens (0..7)."""
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(mean_len + rng.randint(-4, 4))] for _ in range(n)]


@contextlib.contextmanager
def bench_host_cache(nbytes: int = 0):
    """A HostWeightCache of this run only (own file prefix), emptied at the end.

    The node-wide default cache is shared with running workers and tests; the benchmark
    neither evicts their files nor leaves its own behind. It lives in /dev/shm as the
    real one does, unless /dev/shm lacks room for `nbytes` (a container's 64 MB default):
    then in the temp dir, which is file-backed but mapped and populated the same way.
    """
    import shutil
    import tempfile

    from actors.host_cache import HostWeightCache

    shm = Path("/dev/shm")
    shm_dir = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes + 64 * MiB else None
    cache = HostWeightCache(shm_dir=shm_dir or tempfile.gettempdir(), prefix=f"tokenmux-bench-{os.getpid()}")
    try:
        yield cache
    finally:
        for model in list(cache._layouts):
            cache.evict(model)


def engine_for(paths: dict[str, Path], *, num_slots: int, tokens_per_model: int, device: torch.device,
               dtype: str | None, host_cache, policy: str = "token", kernels: str = "reference"):
    """An Engine with `paths` registered, a slot per `num_slots` and KV room for
    `tokens_per_model` tokens of every model at once (no preemption: we time steps, not queues)."""
    from actors.engine import Engine, EngineConfig
    from actors.model_spec import ModelSpec
    from actors.weight_layout import WeightLayout
    from scheduler.kv_blocks import BLOCK_SIZE, KVShape

    tdtype = torch_dtype(dtype)
    slot_bytes, kv_bytes = 0, 0
    for path in paths.values():
        spec = ModelSpec.from_dir(path)
        model_dtype = tdtype or getattr(torch, spec.torch_dtype)
        slot_bytes = max(slot_bytes, weight_bytes(path, model_dtype, kernels, device))
        shape = KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, model_dtype.itemsize)
        per_slab = SLAB_BYTES // shape.block_bytes
        if per_slab < 1:
            raise ValueError(f"{path}: a KV block ({shape.block_bytes} bytes) exceeds a slab ({SLAB_BYTES})")
        blocks = math.ceil(tokens_per_model / BLOCK_SIZE) + 16   # + per-request rounding up
        kv_bytes += (math.ceil(blocks / per_slab) + 1) * SLAB_BYTES
    # detokenize=False: a DeviceWorker's engine under the ingress (the ingress makes the text)
    config = EngineConfig(device=str(device), budget_bytes=kv_bytes + num_slots * (slot_bytes + 4096),
                          kv_bytes=kv_bytes, num_slots=num_slots, slab_bytes=SLAB_BYTES, host_kv_bytes=0,
                          policy=policy, dtype=dtype, kernels=kernels, detokenize=False)
    engine = Engine(config, host_cache=host_cache)
    for name, path in paths.items():
        engine.register_model(name, path)
    return engine


def weight_bytes(path: Path, dtype: torch.dtype, kernels: str, device: torch.device) -> int:
    """Bytes of `path`'s weights in a slot on this kernel path (packed weights are padded)."""
    from actors.kernel_path import KernelPath

    return KernelPath(kernels, device.type).weight_layout(path, dtype).total_bytes


def run_to_completion(engine, requests, max_steps: int = 1_000_000) -> dict[str, list[int]]:
    """Submit `requests` and step until they finish; returns the tokens of each request."""
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps = 0
    while engine.has_unfinished():
        for frame in engine.step():
            if frame.error:
                raise RuntimeError(f"request {frame.request_id} failed: {frame.error}")
            tokens[frame.request_id] += frame.token_ids
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"engine did not finish within {max_steps} steps")
    return tokens


def greedy_requests(model: str, prompts: list[list[int]], new_tokens: int, tag: str):
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(f"{tag}-{model}-{i}", model, tuple(p), params) for i, p in enumerate(prompts)]
