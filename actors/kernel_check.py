"""Which kernel path an engine runs when its config says "auto": the fast path where it is proven
on this very device, else the reference path.

On a CUDA device the fast path (fused projections, decode replayed from CUDA graphs) is checked
once per process before anything is served: a small random-weight Llama checkpoint is written to
a temporary folder, and two small engines, one per path, decode the same greedy requests (batch 1,
and batch 3 padded to a graph bucket of 4). The fast path is taken when every request keeps the
reference's tokens; a mismatch or an error falls back to the reference path, logged as a warning
and reported in the engine's stats (`tokenmux status` shows it). A broken kernel costs speed,
never the cluster. A CPU keeps the reference path: its fast path (packed kernels) stays opt-in,
so CPU figures do not move.
"""
from __future__ import annotations

import functools
import logging
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MiB = 1 << 20
CHECK_TOKENS = 12            # greedy tokens per request
CHECK_PROMPTS = ((3, 17, 29, 4, 11), (7,), (5, 9, 13, 21, 2, 8, 30, 31, 1, 6, 12, 14, 15, 16, 19, 22, 23))


@dataclass(frozen=True)
class KernelChoice:
    kernels: str          # "reference" | "fast": what the engine runs
    warning: str = ""     # why the fast path was refused here ("" when nothing went wrong)


def resolve_kernels(requested: str, device: torch.device) -> KernelChoice:
    """The kernel path for EngineConfig.kernels = `requested` on `device`."""
    if requested != "auto":
        return KernelChoice(requested)
    if device.type != "cuda":
        return KernelChoice("reference")
    return _checked_on(str(device))


@functools.lru_cache(maxsize=None)
def _checked_on(device: str) -> KernelChoice:
    try:
        mismatched = compare_paths(torch.device(device))
    except Exception as exc:   # any failure of the fast path here is a reason to leave it
        warning = f"fast kernel path failed its check on {device} ({type(exc).__name__}: {exc}); using the reference path"
    else:
        if not mismatched:
            logger.info("fast kernel path checked on %s: greedy tokens equal the reference path", device)
            return KernelChoice("fast")
        warning = (f"fast kernel path gave other greedy tokens than the reference path on {device} "
                   f"(requests {mismatched}); using the reference path")
    logger.warning("%s", warning)
    return KernelChoice("reference", warning)


def compare_paths(device: torch.device, fast: str = "fast") -> list[int]:
    """Indices of the check's requests whose greedy tokens differ between the reference path
    and `fast` on `device` (empty: the paths agree)."""
    with tempfile.TemporaryDirectory(prefix="tokenmux-kernel-check-") as folder:
        path = write_check_model(Path(folder))
        reference = _greedy(path, device, "reference")
        other = _greedy(path, device, fast)
    return [i for i, (a, b) in enumerate(zip(reference, other)) if a != b]


def write_check_model(folder: Path) -> Path:
    """A ~1 MB random Llama checkpoint (fp32, GQA, 3 layers), written with transformers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         architectures=["LlamaForCausalLM"])
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(11)
    try:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    finally:
        torch.random.set_rng_state(generator_state)
    return folder


def _greedy(path: Path, device: torch.device, kernels: str) -> list[list[int]]:
    from actors.engine import Engine, EngineConfig
    from actors.host_cache import HostWeightCache
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    cache = HostWeightCache(prefix=f"kcheck-{uuid.uuid4().hex[:8]}")
    try:
        engine = Engine(EngineConfig(device=str(device), budget_bytes=12 * MiB, kv_bytes=4 * MiB, num_slots=2,
                                     slab_bytes=1 * MiB, host_kv_bytes=0, kernels=kernels, detokenize=False),
                        host_cache=cache)
        engine.register_model("check", path)
        params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True)
        out: dict[str, list[int]] = {}
        # batch 1 first (its own graph bucket), then three at once (padded to a bucket of 4)
        for group in ((0,), (0, 1, 2)):
            for i in group:
                request_id = f"r{len(out)}"
                out[request_id] = []
                engine.add_request(GenerateRequest(request_id, "check", CHECK_PROMPTS[i], params))
            while engine.has_unfinished():
                for frame in engine.step():
                    if frame.error is not None:
                        raise RuntimeError(frame.error)
                    out[frame.request_id].extend(frame.token_ids)
        return list(out.values())
    finally:
        cache.close()
