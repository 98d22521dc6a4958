"""Swap-in of a model's weights from the host cache into a device slot, next to the limit.

The swap goes through the real `WeightSlots.ensure_resident`: one slot and two names for
the same checkpoint, so every call evicts the other name and copies the whole model (the
host cache holds the bytes once; both names map the same file). The limit is a raw
`dst.copy_(src)` of the same bytes between the same two buffers (the swapped name's
host-cache mapping -> the slot), timed in the same loop, alternating which goes first so neither sees a warmer cache.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from load_tests.bench.common import median, sync, timed, torch_dtype

logger = logging.getLogger(__name__)


def measure_swap(path: Path, *, device: torch.device, dtype: str | None, repeats: int, host_cache,
                 names: tuple[str, str] = ("swap-a", "swap-b"), kernels: str = "fast") -> dict:
    from actors.device_memory import SLOT_ALIGN, DeviceMemory
    from actors.kernel_path import KernelPath
    from actors.model_spec import ModelSpec
    from actors.weight_slots import WeightSlots

    # the layout the engine's runner reads on this kernel path (packed bytes on the CPU fast path)
    layout = KernelPath(kernels, device.type).weight_layout(
        path, torch_dtype(dtype) or getattr(torch, ModelSpec.from_dir(path).torch_dtype))
    nbytes = layout.total_bytes
    memory = DeviceMemory(-(-nbytes // SLOT_ALIGN) * SLOT_ALIGN, 0, 1, device)
    slots = WeightSlots(memory, host_cache)
    for name in names:
        slots.add_model(name, layout)   # fills the host cache (cold path, not timed)
    dst = memory.slot(0)[:nbytes]       # [nbytes] uint8 on the device
    non_blocking = device.type == "cuda"

    def raw_copy(name: str) -> None:
        # [nbytes] uint8 host-cache mapping of `name` (pinned on GPU hosts): the swap's own source
        dst.copy_(host_cache.flat(name), non_blocking=non_blocking)

    slots.ensure_resident(names[0])     # first touch of every buffer, untimed
    for name in names:
        raw_copy(name)
    sync(device)
    swaps_before = slots.stats()["num_swaps"]
    swap_s, memcpy_s = [], []
    for i in range(repeats):
        name = names[(i + 1) % 2]        # the other name: a real swap every time
        if i % 2 == 0:
            swap_s.append(timed(lambda: slots.ensure_resident(name), device))
            memcpy_s.append(timed(lambda: raw_copy(name), device))
        else:
            memcpy_s.append(timed(lambda: raw_copy(name), device))
            swap_s.append(timed(lambda: slots.ensure_resident(name), device))
    num_swaps = slots.stats()["num_swaps"] - swaps_before
    if num_swaps != repeats:
        raise RuntimeError(f"expected {repeats} swaps, WeightSlots made {num_swaps}")
    swap, limit = median(swap_s), median(memcpy_s)
    logger.info("swap %.4fs, raw copy %.4fs (%d bytes)", swap, limit, nbytes)
    return {
        "swap_s": swap,
        "memcpy_limit_s": limit,
        "swap_vs_memcpy": swap / limit,
        "swap_bytes": nbytes,
        "swap_gb_s": nbytes / swap / 1e9,
        "memcpy_gb_s": nbytes / limit / 1e9,
        "swap_samples_s": swap_s,
        "memcpy_samples_s": memcpy_s,
        "host_cache_pinned": bool(host_cache.pin),
        "swap_layout": f"{kernels} kernel path ({sum(e.packed is not None for e in layout.entries)} packed tensors)",
        "swap_path": f"WeightSlots.ensure_resident, host cache ({'pinned ' if host_cache.pin else ''}shared "
                     f"memory) -> {device.type} slot; limit: dst.copy_(src) of the same buffers",
    }
