"""Which kernel path an engine runs when its config says "auto": the fast path where it is proven
on this very device, else the reference path.

On a CUDA device the fast path (fused projections, decode replayed from CUDA graphs) is checked
once per process before anything is served: a small random-weight Llama checkpoint is written to
a temporary folder, swapped into a slot from the host cache for each path as an engine's weights
are, and both runners decode the same greedy prompts (batch 1, then 3 padded to a graph bucket). The fast path is taken when every request keeps the
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
    """Greedy tokens of the check's prompts through the runner of `kernels`, its weights swapped
    into a slot from the host cache as an engine's are (batch 1, then three sequences at once)."""
    from actors.device_memory import DeviceMemory
    from actors.host_cache import HostWeightCache
    from actors.kernel_path import KernelPath
    from actors.model_runner import ModelRunner, SeqChunk
    from actors.model_spec import ModelSpec
    from actors.weight_slots import WeightSlots

    spec = ModelSpec.from_dir(path)
    kernel_path = KernelPath(kernels, device.type)
    layout = kernel_path.weight_layout(path, torch.float32)
    cache = HostWeightCache(prefix=f"kcheck-{uuid.uuid4().hex[:8]}")
    try:
        memory = DeviceMemory(layout.total_bytes + 2 * 4096, 4096, 1, device)
        slots = WeightSlots(memory, cache, {"check": layout})
        slots.ensure_resident("check")
        params = slots.params("check")
        runner = ModelRunner(spec, device, kernels, cuda_graphs=kernel_path.cuda_graphs)
        blocks_per_seq = -(-(max(map(len, CHECK_PROMPTS)) + CHECK_TOKENS) // 16)
        kv = torch.zeros((1, 3 * blocks_per_seq, spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim),
                         device=device)   # [slabs, blocks, L, 2, 16, Hkv, D]
        out = []
        for group in ((0,), (0, 1, 2)):
            chunks = [SeqChunk(list(CHECK_PROMPTS[i]), 0, list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq)))
                      for j, i in enumerate(group)]
            tokens = [[] for _ in group]
            for _ in range(CHECK_TOKENS):
                picked = runner.forward(params, chunks, kv).argmax(-1).tolist()
                for seq, token in zip(tokens, picked):
                    seq.append(token)
                chunks = [SeqChunk([t], c.start_pos + len(c.token_ids), c.block_ids) for c, t in zip(chunks, picked)]
            out += tokens
        return out
    finally:
        cache.close()
