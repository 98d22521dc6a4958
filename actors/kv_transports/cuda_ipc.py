"""Same-node GPU to GPU KV handoff through CUDA IPC (cupy), no host hop.

Sender: an IPC handle of the device allocation holding the blocks (the worker's KV
region, or a gathered copy kept alive until release) + each block's byte offset in it,
and an interprocess event recorded on the sender's current stream after its writes.
Receiver: opens the handle once per allocation (cached: CUDA refuses a second open in
one context), makes its copy stream wait on the event, copies, and synchronizes before
returning, so the caller may tell the sender to release.

cupy and CUDA are imported lazily; without them `available()` is False and nothing else
in tokenmux notices.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from actors.kv_transports.base import (KVDescriptor, KVTransferError, KVTransport, block_pointers, check_blocks,
                                       copy_from_offsets, copy_into, destination, gather_blocks)

logger = logging.getLogger(__name__)

_EVENT_DISABLE_TIMING = 0x2      # cudaEventDisableTiming
_EVENT_INTERPROCESS = 0x4        # cudaEventInterprocess
_IPC_LAZY_PEER_ACCESS = 0x1      # cudaIpcMemLazyEnablePeerAccess


@functools.cache
def _why_unavailable() -> str | None:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:   # cupy raises CUDARuntimeError without a driver
        return f"CUDA unavailable: {exc}"
    return None


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation holding device pointer `ptr`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise KVTransferError(f"cuMemGetAddressRange failed with CUresult {rc} for pointer {ptr:#x}")
    return base.value, size.value


class CudaIPCTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self):
        why = _why_unavailable()
        if why is not None:
            raise KVTransferError(f"CUDA IPC transport unavailable: {why}")
        import cupy

        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self._exports: dict[str, tuple] = {}   # request_id -> (event, device, kept tensor, its block ids or None)
        self._opened: dict[bytes, int] = {}                            # receiver: handle -> mapped base
        self._streams: dict[int, torch.cuda.Stream] = {}                # receiver: device -> copy stream

    @classmethod
    def available(cls) -> bool:
        why = _why_unavailable()
        if why is not None:
            logger.debug("CUDA IPC KV transport unavailable: %s", why)
        return why is None

    def export(self, kv: torch.Tensor, desc: KVDescriptor, from_pool: bool = False) -> KVDescriptor:
        check_blocks(kv, desc, from_pool)
        if kv.device.type != "cuda":
            raise ValueError(f"CUDA IPC exports CUDA tensors, got one on {kv.device}")
        if desc.request_id in self._exports:
            raise ValueError(f"request {desc.request_id!r} is already exported and not released")
        ptrs = block_pointers(kv, desc.block_ids if from_pool else None)
        base, size = allocation_range(min(ptrs))
        if max(ptrs) + desc.block_bytes > base + size:
            # Blocks spread over several allocations: gather them into one, kept until release.
            kv = gather_blocks(kv, desc.block_ids) if from_pool else kv.contiguous()
            from_pool = False
            ptrs = block_pointers(kv, None)
            base, size = allocation_range(kv.data_ptr())
        device = kv.device.index if kv.device.index is not None else torch.cuda.current_device()
        with self._cupy.cuda.Device(device):
            mem_handle = self._rt.ipcGetMemHandle(base)
            event = self._rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS)
            self._rt.eventRecord(event, torch.cuda.current_stream(device).cuda_stream)
            event_handle = self._rt.ipcGetEventHandle(event)
        # kept alive until release; the same process reads its blocks from here
        self._exports[desc.request_id] = (event, device, kv, desc.block_ids if from_pool else None)
        handle = {
            "mem": bytes(mem_handle), "event": bytes(event_handle), "alloc_bytes": size,
            "offsets": [p - base for p in ptrs], "pid": os.getpid(),
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        }
        return desc.with_handle(self.name, handle)

    def import_(self, desc: KVDescriptor, out: torch.Tensor | None = None,
                dst_block_ids: list[int] | None = None) -> torch.Tensor:
        if desc.transport != self.name:
            raise ValueError(f"descriptor is for transport {desc.transport!r}, not {self.name!r}")
        device = self._device_for(desc, out)
        out = destination(desc, out, dst_block_ids, device=f"cuda:{device}")
        bb, offsets = desc.block_bytes, desc.handle.get("offsets", [])
        if len(offsets) != desc.num_blocks or max(offsets) + bb > desc.handle["alloc_bytes"]:
            raise KVTransferError(f"KV handle of request {desc.request_id!r} points outside its allocation")
        if desc.handle.get("pid") == os.getpid() and desc.request_id in self._exports:
            # Sender and receiver in one process: CUDA cannot open its own IPC handle.
            _, _, kv, block_ids = self._exports[desc.request_id]
            copy_into(out, (gather_blocks(kv, block_ids) if block_ids is not None else kv).to(out.device),
                      dst_block_ids)
            return out
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        try:
            with self._cupy.cuda.Device(device):
                base = self._open(desc.handle["mem"])
                event = self._rt.ipcOpenEventHandle(desc.handle["event"])
                self._rt.streamWaitEvent(stream.cuda_stream, event, 0)   # the sender's writes come first
                src = self._wrap(base, desc.handle["alloc_bytes"], device)
                with torch.cuda.stream(stream):
                    copy_from_offsets(src, offsets, desc, out, dst_block_ids)
                stream.synchronize()
                self._rt.eventDestroy(event)
        except self._cupy.cuda.runtime.CUDARuntimeError as exc:
            raise KVTransferError(f"CUDA IPC import of request {desc.request_id!r} failed: {exc}") from exc
        return out

    def release(self, desc: KVDescriptor) -> None:
        if desc.request_id not in self._exports:
            raise ValueError(f"request {desc.request_id!r} was not exported by this transport")
        event, device, *_kept = self._exports.pop(desc.request_id)
        with self._cupy.cuda.Device(device):
            self._rt.eventDestroy(event)

    def close(self) -> None:
        for request_id in list(self._exports):
            event, device, *_ = self._exports.pop(request_id)
            with self._cupy.cuda.Device(device):
                self._rt.eventDestroy(event)
        for base in self._opened.values():
            self._rt.ipcCloseMemHandle(base)
        self._opened.clear()

    def _device_for(self, desc: KVDescriptor, out: torch.Tensor | None) -> int:
        if out is not None:
            if out.device.type != "cuda":
                raise ValueError(f"CUDA IPC imports into CUDA tensors, got one on {out.device}")
            return out.device.index if out.device.index is not None else torch.cuda.current_device()
        return torch.cuda.current_device()

    def _open(self, mem_handle: bytes) -> int:
        if mem_handle not in self._opened:
            self._opened[mem_handle] = self._rt.ipcOpenMemHandle(mem_handle, _IPC_LAZY_PEER_ACCESS)
        return self._opened[mem_handle]

    def _wrap(self, ptr: int, nbytes: int, device: int) -> torch.Tensor:
        """A uint8 torch tensor `[nbytes]` over device memory this process does not own."""
        cp = self._cupy
        memory = cp.cuda.UnownedMemory(ptr, nbytes, owner=self, device_id=device)
        array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        return torch.as_tensor(array, device=f"cuda:{device}")
