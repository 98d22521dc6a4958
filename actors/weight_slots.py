"""Which model's weights sit in which device slot, and the swap-in that puts them there.

A swap-in is ONE bulk copy, host cache flat buffer -> slot bytes, because both sides use
the same WeightLayout; no per-tensor work happens on that path. `params(model)` hands
the runner typed views into the slot, built once per (slot, model) and cached; a weight
packed for oneDNN is viewed as an mkldnn tensor over the same slot bytes.

Slots are reused least-recently-used first. The model the engine is running (the last
`ensure_resident`) and a model whose prefetch is in flight are never taken by a
prefetch. `prefetch(model)` starts the copy in the background -- a side CUDA stream on
GPU (ordered after the work already queued on the compute stream, since that work may
still read the victim slot), a worker thread on CPU (torch's copy releases the GIL) --
and `ensure_resident` of that model waits for it.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from actors.device_memory import DeviceMemory
from actors.host_cache import HostWeightCache
from actors.packed_linear import packed_view
from actors.weight_layout import WeightLayout

logger = logging.getLogger(__name__)


@dataclass
class _Inflight:
    slot: int
    started: float
    event: torch.cuda.Event | None = None     # GPU: recorded after the copy
    future: Future | None = None              # CPU: its result is the time the copy ended
    start_event: torch.cuda.Event | None = None   # GPU: recorded before the copy

    def copy_seconds(self) -> float:
        """How long the copy took (call once it is done)."""
        if self.event is not None:
            return self.start_event.elapsed_time(self.event) / 1e3
        return self.future.result() - self.started

    def done(self) -> bool:
        return self.event.query() if self.event is not None else self.future.done()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        else:
            self.future.result()


@dataclass
class SwapStats:
    num_swaps: int = 0            # bulk copies started (blocking or prefetch)
    num_prefetches: int = 0
    num_hits: int = 0             # ensure_resident with the weights already there
    swap_bytes: int = 0
    blocking_seconds: float = 0.0  # time ensure_resident spent copying or waiting
    per_model: dict[str, int] = field(default_factory=dict)


class WeightSlots:
    def __init__(self, device_memory: DeviceMemory, host_cache: HostWeightCache,
                 layouts: dict[str, WeightLayout] | None = None):
        self.mem = device_memory
        self.host = host_cache
        self.layouts: dict[str, WeightLayout] = {}
        self._slot_model: list[str | None] = [None] * device_memory.num_slots
        self._lru: OrderedDict[str, int] = OrderedDict()     # resident model -> slot, oldest first
        self._inflight: dict[str, _Inflight] = {}
        self._views: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._current: str | None = None
        # model -> seconds its latest swap-in copy took, until ensure_resident first uses it
        self._copy_s: dict[str, float] = {}
        self._stats = SwapStats()
        self._cuda = device_memory.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device_memory.device)
        else:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-prefetch")
        for name, layout in (layouts or {}).items():
            self.add_model(name, layout)

    def add_model(self, model: str, layout: WeightLayout) -> None:
        """Accept `model` if it fits a slot, and bring it into the host cache (cold path)."""
        self.mem.check_fits(model, layout.total_bytes)
        self.host.add(model, layout)
        self.host.flat(model)
        self.layouts[model] = layout

    def remove_model(self, model: str, evict_host: bool = False) -> None:
        """Forget `model`: its slot is free again, its views dropped, its host-cache mapping released
        here (and its node-wide file unlinked with `evict_host`: nobody on the node serves it any more)."""
        self._layout(model)
        inflight = self._inflight.pop(model, None)
        if inflight is not None:   # a copy still writing into the slot: let it end before the slot is reused
            inflight.wait()
        slot = self._lru.pop(model, None) if inflight is None else inflight.slot
        if slot is not None and self._slot_model[slot] == model:
            self._slot_model[slot] = None
        for key in [k for k in self._views if k[1] == model]:
            del self._views[key]
        if self._current == model:
            self._current = None
        self._copy_s.pop(model, None)
        del self.layouts[model]
        if evict_host:
            self.host.evict(model)
        else:
            self.host.forget(model)

    def resident(self) -> set[str]:
        if self._inflight:
            self._settle()
        return set(self._lru)

    def ensure_resident(self, model: str) -> float:
        """Make `model`'s weights usable in a slot; returns the seconds spent waiting (0 if resident)."""
        layout = self._layout(model)
        start = time.perf_counter()
        self._current = model
        if model in self._lru:
            self._lru.move_to_end(model)
            self._stats.num_hits += 1
            return 0.0
        inflight = self._inflight.pop(model, None)
        if inflight is not None:
            inflight.wait()
            if self._cuda:   # the compute stream must also see the finished copy
                torch.cuda.current_stream(self.mem.device).wait_event(inflight.event)
            self._lru[model] = inflight.slot
            self._copy_s[model] = inflight.copy_seconds()
        else:
            slot = self._take_slot(for_prefetch=False)
            dst = self.mem.slot(slot)[:layout.total_bytes]
            dst.copy_(self.host.flat(model), non_blocking=self._cuda)
            if self._cuda:
                torch.cuda.current_stream(self.mem.device).synchronize()
            self._assign(model, slot)
            self._lru[model] = slot
        elapsed = time.perf_counter() - start
        if inflight is None:   # a copy made here took what the step waited
            self._copy_s[model] = elapsed
        self._stats.blocking_seconds += elapsed
        return elapsed

    def take_copy_seconds(self, model: str) -> float | None:
        """Seconds the swap-in that put `model` in its slot took, the first time it is asked after
        that swap (prefetched or not, hidden or not); None when no swap happened since.
        What a switch costs the device, where ensure_resident's answer is only what it blocked."""
        return self._copy_s.pop(model, None)

    def prefetch(self, model: str) -> bool:
        """Start copying `model` into a free or least-recently-used slot in the background.
        False when every slot is held by the current model or another prefetch."""
        layout = self._layout(model)
        if model in self._lru or model in self._inflight:
            return True
        slot = self._take_slot(for_prefetch=True)
        if slot is None:
            return False
        dst = self.mem.slot(slot)[:layout.total_bytes]
        src = self.host.flat(model)
        inflight = _Inflight(slot, time.perf_counter())
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.mem.device))
            with torch.cuda.stream(self._stream):
                inflight.start_event = torch.cuda.Event(enable_timing=True)
                inflight.start_event.record(self._stream)
                dst.copy_(src, non_blocking=True)
                inflight.event = torch.cuda.Event(enable_timing=True)
                inflight.event.record(self._stream)
        else:
            inflight.future = self._executor.submit(_copy_then_time, dst, src)
        self._assign(model, slot)
        self._inflight[model] = inflight
        self._stats.num_prefetches += 1
        return True

    def params(self, model: str) -> dict[str, torch.Tensor]:
        """name -> typed view into the model's slot; the model must be resident."""
        self._settle()
        if model not in self._lru:
            raise RuntimeError(f"model {model!r} is not resident; call ensure_resident first")
        slot = self._lru[model]
        views = self._views.get((slot, model))
        if views is None:
            flat = self.mem.slot(slot)
            views = {e.name: _view(flat[e.offset:e.offset + e.nbytes], e) for e in self.layouts[model].entries}
            self._views[(slot, model)] = views
        return views

    def stats(self) -> dict:
        s = self._stats
        return {"num_swaps": s.num_swaps, "num_prefetches": s.num_prefetches, "num_hits": s.num_hits,
                "swap_bytes": s.swap_bytes, "blocking_seconds": s.blocking_seconds,
                "swaps_per_model": dict(s.per_model), "resident": sorted(self.resident())}

    def _layout(self, model: str) -> WeightLayout:
        if model not in self.layouts:
            raise KeyError(f"model {model!r} is not registered with the weight slots; known: {sorted(self.layouts)}")
        return self.layouts[model]

    def _settle(self) -> None:
        """Promote finished prefetches to resident (as most recently used: they run next)."""
        for model, inflight in list(self._inflight.items()):
            if inflight.done():
                inflight.wait()   # surfaces a CPU copy's exception
                del self._inflight[model]
                self._lru[model] = inflight.slot
                self._copy_s[model] = inflight.copy_seconds()

    def _take_slot(self, for_prefetch: bool) -> int | None:
        self._settle()
        for i, owner in enumerate(self._slot_model):
            if owner is None:
                return i
        for model, slot in self._lru.items():   # oldest first
            if not (for_prefetch and model == self._current):
                del self._lru[model]
                return slot
        if for_prefetch:
            return None
        # every slot is being prefetched into: let the oldest finish, then reuse it
        model, inflight = next(iter(self._inflight.items()))
        inflight.wait()
        del self._inflight[model]
        return inflight.slot

    def _assign(self, model: str, slot: int) -> None:
        self._slot_model[slot] = model
        nbytes = self.layouts[model].total_bytes
        self._stats.num_swaps += 1
        self._stats.swap_bytes += nbytes
        self._stats.per_model[model] = self._stats.per_model.get(model, 0) + 1
        logger.debug("weights: %s -> slot %d (%.1f MB)", model, slot, nbytes / 1e6)


def _view(data: torch.Tensor, entry) -> torch.Tensor:
    """# uint8 [entry.nbytes] of a slot -> the entry's tensor, no copy."""
    if entry.packed is not None:
        return packed_view(data, entry.shape, entry.dtype, entry.packed)
    return data.view(entry.dtype).view(entry.shape)


def _copy_then_time(dst: torch.Tensor, src: torch.Tensor) -> float:
    """A prefetch on the CPU: the copy, then when it ended (perf_counter)."""
    dst.copy_(src)
    return time.perf_counter()
