"""Same-node KV handoff through files in /dev/shm, for workers on a CPU host.

Two ways out of the sender:
  * zero copy: the sender's KV pool lives in a region from `allocate_region` (a shared
    file every process on the node can map); export only records the blocks' offsets
    and the receiver copies once, straight out of the sender's pool;
  * staged: the blocks are copied (one gather) into a staging file, which the sender
    reuses after release, so steady-state handoffs touch no fresh pages.
The receiver maps each file once and keeps the mapping while the file lives.
"""
from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.kv_transports.base import KVDescriptor, KVTransferError, KVTransport, check_blocks, copy_from_offsets, destination, gather_blocks

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
MIN_STAGING_BYTES = 1 << 20
MAX_RECEIVER_MAPPINGS = 16


@dataclass
class _Mapped:
    path: Path
    nbytes: int
    inode: int
    mm: mmap.mmap
    tensor: torch.Tensor   # uint8 [nbytes] over mm

    @classmethod
    def open(cls, path: Path, nbytes: int | None = None) -> _Mapped:
        """Create (nbytes given) or attach to (nbytes None) a shared file and map it."""
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if nbytes is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if nbytes is not None:
                os.ftruncate(fd, nbytes)
            stat = os.fstat(fd)
            mm = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(path, stat.st_size, stat.st_ino, mm, torch.frombuffer(mm, dtype=torch.uint8))

    def base(self) -> int:
        return self.tensor.data_ptr()

    def close(self) -> None:
        self.tensor = None
        try:
            self.mm.close()
        except BufferError:   # a caller still holds a view; the mapping goes with it
            logger.debug("mapping of %s still in use; left to the garbage collector", self.path)


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self, shm_dir: str | Path = DEFAULT_SHM_DIR, prefix: str = "tokenmux-kv",
                 max_staging_bytes: int = 1 << 30):
        self.shm_dir = Path(shm_dir)
        if not self.shm_dir.is_dir():
            raise ValueError(f"shared-memory directory {self.shm_dir} does not exist")
        if "/" in prefix or not prefix:
            raise ValueError(f"prefix must be a plain file-name prefix, got {prefix!r}")
        self.prefix = f"{prefix}-{os.getpid()}"
        self.max_staging_bytes = max_staging_bytes
        self._regions: list[_Mapped] = []
        self._free_staging: list[_Mapped] = []
        self._exports: dict[str, _Mapped | None] = {}         # request_id -> staging in use
        self._mapped: OrderedDict[str, _Mapped] = OrderedDict()   # receiver side, LRU

    def allocate_region(self, nbytes: int) -> torch.Tensor:
        """A node-shared uint8 buffer `[nbytes]`; KV blocks inside it export without a copy."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        region = _Mapped.open(self._new_path("region"), nbytes)
        self._regions.append(region)
        return region.tensor

    def export(self, kv: torch.Tensor, desc: KVDescriptor, from_pool: bool = False) -> KVDescriptor:
        check_blocks(kv, desc, from_pool)
        if desc.request_id in self._exports:
            raise ValueError(f"request {desc.request_id!r} is already exported and not released")
        # Block i of kv starts at kv.data_ptr() + i * stride(0) bytes (each block is contiguous).
        step = kv.stride(0) * kv.element_size()
        ptrs = [kv.data_ptr() + step * i for i in (desc.block_ids if from_pool else range(kv.shape[0]))]
        region = self._region_holding(ptrs, desc.block_bytes) if kv.device.type == "cpu" else None
        if region is not None:
            offsets = [p - region.base() for p in ptrs]
            self._exports[desc.request_id] = None
        else:
            region = self._take_staging(desc.nbytes)
            staged = region.tensor[:desc.nbytes].view(desc.torch_dtype).view(desc.num_blocks, *desc.block_shape)
            if from_pool:
                gather_blocks(kv, desc.block_ids, out=staged)
            else:
                staged.copy_(kv)
            offsets = [i * desc.block_bytes for i in range(desc.num_blocks)]
            self._exports[desc.request_id] = region
        handle = {"path": str(region.path), "inode": region.inode, "offsets": offsets}
        return desc.with_handle(self.name, handle)

    def import_(self, desc: KVDescriptor, out: torch.Tensor | None = None,
                dst_block_ids: list[int] | None = None) -> torch.Tensor:
        out = destination(desc, out, dst_block_ids)
        if desc.transport != self.name:
            raise ValueError(f"descriptor is for transport {desc.transport!r}, not {self.name!r}")
        try:
            mapped = self._attach(Path(desc.handle["path"]), desc.handle["inode"])
            offsets = desc.handle["offsets"]
        except (KeyError, OSError) as exc:
            raise KVTransferError(f"KV of request {desc.request_id!r} is not readable: {exc}") from exc
        bb = desc.block_bytes
        if len(offsets) != desc.num_blocks or min(offsets) < 0 or max(offsets) + bb > mapped.nbytes:
            raise KVTransferError(f"KV handle of request {desc.request_id!r} points outside {mapped.path}")
        copy_from_offsets(mapped.tensor, offsets, desc, out, dst_block_ids)
        return out

    def release(self, desc: KVDescriptor) -> None:
        if desc.request_id not in self._exports:
            raise ValueError(f"request {desc.request_id!r} was not exported by this transport")
        staging = self._exports.pop(desc.request_id)
        if staging is None:
            return
        cached = sum(m.nbytes for m in self._free_staging)
        if cached + staging.nbytes <= self.max_staging_bytes:
            self._free_staging.append(staging)
        else:
            self._unlink(staging)

    def close(self) -> None:
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        staging = [m for m in self._exports.values() if m is not None]
        for mapped in self._free_staging + staging + self._regions:
            self._unlink(mapped)
        self._free_staging, self._regions, self._exports = [], [], {}

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown: modules may already be gone
            pass

    def _region_holding(self, ptrs: list[int], block_bytes: int) -> _Mapped | None:
        """The shared region holding every block starting at `ptrs`, or None."""
        first, last = min(ptrs), max(ptrs) + block_bytes
        for region in self._regions:
            if region.base() <= first and last <= region.base() + region.nbytes:
                return region
        return None

    def _take_staging(self, nbytes: int) -> _Mapped:
        fits = [m for m in self._free_staging if m.nbytes >= nbytes]
        if fits:
            best = min(fits, key=lambda m: m.nbytes)
            self._free_staging.remove(best)
            return best
        size = max(MIN_STAGING_BYTES, 1 << (nbytes - 1).bit_length())   # power of two: reusable
        return _Mapped.open(self._new_path("staging"), size)

    def _attach(self, path: Path, inode: int) -> _Mapped:
        key = str(path)
        for own in self._regions + self._free_staging + [m for m in self._exports.values() if m]:
            if own.path == path:   # sender and receiver in one process
                return own
        mapped = self._mapped.get(key)
        if mapped is not None and mapped.inode == inode:
            self._mapped.move_to_end(key)
            return mapped
        if mapped is not None:
            self._mapped.pop(key).close()
        mapped = _Mapped.open(path)
        if mapped.inode != inode:
            mapped.close()
            raise FileNotFoundError(f"{path} was replaced by another file")
        self._mapped[key] = mapped
        while len(self._mapped) > MAX_RECEIVER_MAPPINGS:
            self._mapped.popitem(last=False)[1].close()
        return mapped

    def _new_path(self, kind: str) -> Path:
        return self.shm_dir / f"{self.prefix}-{kind}-{uuid.uuid4().hex[:12]}"

    def _unlink(self, mapped: _Mapped) -> None:
        mapped.close()
        try:
            mapped.path.unlink()
        except FileNotFoundError:
            pass
