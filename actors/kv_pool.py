"""Typed views of the unified KV pool, and whole-block copies between device and host.

The pool is one byte buffer carved into slabs of `slab_bytes`; the BlockManager
(scheduler/kv_blocks.py) gives each slab to one KV shape at a time. For a shape S the
pool reads as

    view(S, dtype)   # [num_slabs, blocks_per_slab, num_layers, 2, 16, num_kv_heads, head_dim]

where slab s starts at byte s * slab_bytes and only its first blocks_per_slab * block_bytes
bytes are used by S. Views of different shapes alias the same memory; the BlockManager
keeps them on different slabs. One block is contiguous across layers, k and v, so
moving a request's KV between device and host is one indexed copy of whole blocks.
A block id g of shape S is block g % blocks_per_slab of slab g // blocks_per_slab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.kv_blocks import BLOCK_SIZE, KVShape


class DeviceKVPool:
    def __init__(self, buffer: torch.Tensor, slab_bytes: int):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"KV pool buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} "
                             f"with shape {tuple(buffer.shape)}")
        if not isinstance(slab_bytes, int) or slab_bytes <= 0 or slab_bytes % 256:
            raise ValueError(f"slab_bytes must be a positive multiple of 256, got {slab_bytes!r}")
        if buffer.numel() < slab_bytes:
            raise ValueError(f"KV buffer of {buffer.numel()} bytes is smaller than one slab ({slab_bytes})")
        self.buffer = buffer
        self.slab_bytes = slab_bytes
        self.num_slabs = buffer.numel() // slab_bytes
        self._views: dict[tuple, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def blocks_per_slab(self, shape: KVShape) -> int:
        return self.slab_bytes // shape.block_bytes

    def view(self, shape: KVShape, dtype: torch.dtype) -> torch.Tensor:
        """The pool as blocks of `shape`: [num_slabs, blocks_per_slab, L, 2, 16, H, D] (cached)."""
        key = (shape, dtype)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        if dtype.itemsize != shape.dtype_bytes:
            raise ValueError(f"dtype {dtype} has {dtype.itemsize} bytes but the KV shape says {shape.dtype_bytes}")
        per_slab = self.blocks_per_slab(shape)
        if per_slab == 0:
            raise ValueError(f"a KV block of {shape.block_bytes} bytes does not fit a slab of {self.slab_bytes}")
        block_dims = (shape.num_layers, 2, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
        typed = self.buffer[:self.num_slabs * self.slab_bytes].view(dtype)
        view = typed.as_strided(
            (self.num_slabs, per_slab, *block_dims),
            (self.slab_bytes // dtype.itemsize, *_contiguous_strides(block_dims)),
        )
        self._views[key] = view
        return view


class HostKVPool(DeviceKVPool):
    """Swap space for preempted KV: same slab structure, in host memory (pinned with CUDA)."""

    def __init__(self, num_slabs: int, slab_bytes: int, pin: bool | None = None):
        if not isinstance(num_slabs, int) or num_slabs <= 0:
            raise ValueError(f"num_slabs must be a positive int, got {num_slabs!r}")
        pin = torch.cuda.is_available() if pin is None else pin
        super().__init__(torch.zeros(num_slabs * slab_bytes, dtype=torch.uint8, pin_memory=pin), slab_bytes)


def _contiguous_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of [block, *dims] with each block contiguous: (numel(dims), *strides(dims))."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return (step, *reversed(strides))


def block_index(view: torch.Tensor, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(slab indices, in-slab indices) of global block ids, as index tensors on the view's device."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    per_slab = view.shape[1]
    if len(block_ids) and (int(ids.min()) < 0 or int(ids.max()) >= view.shape[0] * per_slab):
        raise ValueError(f"block ids out of range [0, {view.shape[0] * per_slab}): {block_ids}")
    return (ids // per_slab).to(view.device), (ids % per_slab).to(view.device)


def copy_blocks(src_view: torch.Tensor, src_ids: list[int], dst_view: torch.Tensor, dst_ids: list[int]) -> None:
    """Copy whole blocks src_view[src_ids[i]] -> dst_view[dst_ids[i]] (any devices, same block shape)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    if src_view.shape[2:] != dst_view.shape[2:] or src_view.dtype != dst_view.dtype:
        raise ValueError(f"block shapes differ: {tuple(src_view.shape[2:])} {src_view.dtype} vs "
                         f"{tuple(dst_view.shape[2:])} {dst_view.dtype}")
    if not src_ids:
        return
    blocks = src_view[block_index(src_view, src_ids)]          # [n, L, 2, 16, H, D], one gather
    dst_view[block_index(dst_view, dst_ids)] = blocks.to(dst_view.device)   # one transfer, one scatter


@dataclass(frozen=True)
class KVBlocks:
    """Some blocks of one model's KV inside a pool, in token order: what a KV handoff reads or fills.

    view: the pool as that model's blocks (`DeviceKVPool.view`), `[slabs, per_slab, L, 2, 16, H, D]`.
    """

    view: torch.Tensor
    block_ids: tuple[int, ...]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.view.shape[2:])   # (L, 2, 16, H, D)

    @property
    def dtype_name(self) -> str:
        return str(self.view.dtype).removeprefix("torch.")

    @property
    def grid(self) -> torch.Tensor | None:
        """The pool as `[slabs * per_slab, L, 2, 16, H, D]` indexed by block id; None when slabs
        have a tail (then block ids are not evenly strided and only the 2-level view exists)."""
        v = self.view
        if v.stride(0) != v.shape[1] * v.stride(1):
            return None
        return v.view(v.shape[0] * v.shape[1], *v.shape[2:])

    def gather(self) -> torch.Tensor:
        """The blocks as one new `[n, L, 2, 16, H, D]` tensor."""
        return self.view[block_index(self.view, list(self.block_ids))]

    def scatter(self, blocks: torch.Tensor) -> None:
        """Write `[n, L, 2, 16, H, D]` into the blocks, block i to block_ids[i]."""
        self.view[block_index(self.view, list(self.block_ids))] = blocks.to(self.view.device)
