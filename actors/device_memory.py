"""The worker's device memory: one buffer reserved at start, carved into KV + weight slots.

    [ KV region (kv_bytes) | slot 0 | slot 1 | ... | slot N-1 ]   one torch.empty(total_bytes)

Nothing is allocated after start: a model switch copies weights into a slot, the KV
pool lives in the KV region, and the caching allocator never churns (no empty_cache).
On a CPU host the "device" is the same buffer in ordinary memory, touched at start so
the budget is really committed, and a model that does not fit is refused the same way.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

SLOT_ALIGN = 256   # slots start where a CUDA allocation would


def format_bytes(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


class DeviceMemory:
    def __init__(self, total_bytes: int, kv_bytes: int, num_slots: int, device: str | torch.device = "cpu",
                 kv_buffer: torch.Tensor | None = None):
        """kv_buffer: an external uint8 buffer `[>= kv_bytes]` for the KV region (e.g. a node-shared
        region, so a KV handoff exports without a copy); the budget still counts it."""
        for name, value in (("total_bytes", total_bytes), ("kv_bytes", kv_bytes), ("num_slots", num_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        kv_end = (kv_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        slot_bytes = (total_bytes - kv_end) // num_slots // SLOT_ALIGN * SLOT_ALIGN
        if slot_bytes <= 0:
            raise ValueError(
                f"device budget {format_bytes(total_bytes)} leaves no room for {num_slots} weight slots "
                f"after a KV region of {format_bytes(kv_bytes)}"
            )
        self.device = torch.device(device)
        self.total_bytes = total_bytes
        self.kv_bytes = kv_bytes
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        if kv_buffer is not None and (kv_buffer.dtype != torch.uint8 or kv_buffer.dim() != 1
                                      or kv_buffer.numel() < kv_bytes or kv_buffer.device != self.device):
            raise ValueError(f"kv_buffer must be a 1-D uint8 tensor of >= {kv_bytes} bytes on {self.device}, got "
                             f"{kv_buffer.dtype} {tuple(kv_buffer.shape)} on {kv_buffer.device}")
        own_kv = kv_end if kv_buffer is None else 0
        self.buffer = torch.empty(own_kv + num_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            _advise_huge_pages(self.buffer)
            self.buffer.zero_()   # commit the pages now, so the first swap-in does not fault them in
        self.kv_buffer = (self.buffer if kv_buffer is None else kv_buffer)[:kv_bytes]  # [kv_bytes]
        self._slots = [self.buffer[own_kv + i * slot_bytes: own_kv + (i + 1) * slot_bytes]
                       for i in range(num_slots)]                                      # each [slot_bytes]
        logger.info("device memory on %s: %s = KV %s + %d slots of %s", self.device,
                    format_bytes(total_bytes), format_bytes(kv_bytes), num_slots, format_bytes(slot_bytes))

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a uint8 tensor `[slot_bytes]` inside the one buffer."""
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} out of range (num_slots={self.num_slots})")
        return self._slots[index]

    def check_fits(self, model: str, weight_bytes: int) -> None:
        """Refuse a model whose weights cannot fit one slot, with the numbers."""
        if weight_bytes > self.slot_bytes:
            raise ValueError(
                f"model {model!r} needs {format_bytes(weight_bytes)} of weights but a slot holds "
                f"{format_bytes(self.slot_bytes)} (budget {format_bytes(self.total_bytes)} = "
                f"KV {format_bytes(self.kv_bytes)} + {self.num_slots} slots)"
            )


def _advise_huge_pages(buffer: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages over a CPU buffer (before its pages are touched).

    A forward streams every weight of the model once per step; with 4 KiB pages that is a
    TLB miss every 4 KiB, with 2 MiB pages almost none (~10% faster fp32 decode on one core,
    where decode is bound by memory bandwidth). Best effort: where THP is off or madvise is
    refused, the buffer simply stays on small pages."""
    import ctypes

    huge = 2 << 20
    start = -(-buffer.data_ptr() // huge) * huge
    length = (buffer.data_ptr() + buffer.numel() - start) // huge * huge
    if length <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, length, 14) != 0:   # 14 = MADV_HUGEPAGE
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        logger.debug("no madvise here (%s)", e)
