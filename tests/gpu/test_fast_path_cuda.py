"""The fast path on a GPU: fused weights, decode replayed from CUDA graphs. Its greedy
output against the reference path on the same device (divergence only at near ties),
and the graphs really replay. Skipped without CUDA (tests/gpu/run.sh runs it)."""
from __future__ import annotations

import pytest
import torch

from actors.engine import Engine, EngineConfig
from actors.zoo.zoo import ensure_model
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20


def _run(kernels: str, names: list[str]) -> tuple[dict, Engine]:
    engine = Engine(EngineConfig(device="cuda", budget_bytes=64 * MiB + 3 * 32 * MiB, kv_bytes=64 * MiB, num_slots=3,
                                 slab_bytes=1 * MiB, host_kv_bytes=0, kernels=kernels))
    for n in names:
        engine.register_model(n, ensure_model(n))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for n in names:
        for i in range(5):   # batch 5 pads to the graph bucket of 8
            engine.add_request(GenerateRequest(f"{n}-{i}", n, tuple(range(10 + i, 30 + 3 * i)), params))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for frame in engine.step():
            assert frame.error is None, frame.error
            out.setdefault(frame.request_id, []).extend(frame.token_ids)
    return out, engine


def test_cuda_graph_decode_matches_the_reference_path():
    names = ["llama-tiny-b", "qwen2-tiny-a"]
    ref, _ = _run("reference", names)
    fast, engine = _run("fast", names)
    assert sum(m.runner.graphs.num_replays for m in engine.models.values()) > 0
    same = sum(ref[k] == fast[k] for k in ref)
    assert same >= len(ref) - 1, f"only {same}/{len(ref)} requests kept their greedy tokens"


def test_auto_takes_the_fast_path_after_its_check_on_this_gpu():
    """Serving's default (kernels="auto"): the check of actors/kernel_check.py passes on this
    device, so an engine runs the fast path, with no warning for `tokenmux status`."""
    from actors import kernel_check

    assert kernel_check.compare_paths(torch.device("cuda")) == []
    engine = Engine(EngineConfig(device="cuda", budget_bytes=64 * MiB + 2 * 32 * MiB, kv_bytes=64 * MiB, num_slots=2,
                                 slab_bytes=1 * MiB, host_kv_bytes=0))
    assert engine.kernels == "fast" and engine.stats().kernel_warning == ""
