"""Unified KV block accounting: one pool of slabs shared by models of different KV shapes.

The pool is `num_slabs` slabs of `slab_bytes`. A slab is given to one KVShape when that
shape first needs room, holds `blocks_per_slab(shape)` blocks of it, and goes back to the
free list as soon as all its blocks are free, so memory moves between models as their
load moves. Block id g of shape S names slab g // blocks_per_slab(S), index
g % blocks_per_slab(S); the device pool (actors/kv_pool.py) views the same bytes that way.
The host KV swap space is a second BlockManager of the same form.

A tensor-parallel model's blocks are decided by its group's leader for every rank, each of
which serves other models from its own pool too: its shape is `dedicate`d the same slabs on
every rank, holds them for good and takes no other.
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE = 16  # tokens per KV block


def blocks_for_tokens(num_tokens: int) -> int:
    """Blocks needed to hold the KV of `num_tokens` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // BLOCK_SIZE)


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVShape.{name} must be a positive integer, got {value!r}")

    @property
    def block_bytes(self) -> int:
        # one block = [L, 2 (K|V), 16, H_kv, D] elements, contiguous across layers
        return self.num_layers * 2 * BLOCK_SIZE * self.num_kv_heads * self.head_dim * self.dtype_bytes


class BlockManager:
    def __init__(self, num_slabs: int, slab_bytes: int):
        if not isinstance(num_slabs, int) or num_slabs < 0:
            raise ValueError(f"num_slabs must be a non-negative integer, got {num_slabs!r}")
        if not isinstance(slab_bytes, int) or slab_bytes <= 0:
            raise ValueError(f"slab_bytes must be a positive integer, got {slab_bytes!r}")
        self.num_slabs = num_slabs
        self.slab_bytes = slab_bytes
        self._slab_shape: list[KVShape | None] = [None] * num_slabs
        self._slab_free: list[set[int]] = [set() for _ in range(num_slabs)]  # free indices in slab
        self._free_slabs: list[int] = list(range(num_slabs - 1, -1, -1))  # stack: lowest on top
        self._shape_slabs: dict[KVShape, set[int]] = {}
        self._dedicated: set[KVShape] = set()   # shapes that hold their slabs for good, and only those

    def blocks_per_slab(self, shape: KVShape) -> int:
        return self.slab_bytes // shape.block_bytes

    def capacity_blocks(self, shape: KVShape) -> int:
        """Blocks of `shape` the pool holds when it is empty."""
        slabs = len(self._shape_slabs[shape]) if shape in self._dedicated else self.num_slabs
        return slabs * self.blocks_per_slab(shape)

    def num_free_blocks(self, shape: KVShape) -> int:
        """Blocks of `shape` that can be allocated now, counting whole free slabs."""
        partial = sum(len(self._slab_free[s]) for s in self._shape_slabs.get(shape, ()))
        if shape in self._dedicated:
            return partial
        return partial + len(self._free_slabs) * self.blocks_per_slab(shape)

    def dedicate(self, shape: KVShape, num_slabs: int) -> list[int]:
        """Give `shape` the `num_slabs` highest-numbered free slabs for good, and no other slab
        from now on. Ranks that dedicate the same shapes in the same order from the same free
        slabs get the same slabs. Returns them."""
        per_slab = self.blocks_per_slab(shape)
        if per_slab == 0:
            raise ValueError(f"a block of {shape} ({shape.block_bytes} bytes) does not fit in a slab of "
                             f"{self.slab_bytes} bytes")
        if shape in self._shape_slabs:
            raise ValueError(f"{shape} already holds slabs of this pool")
        if not 0 < num_slabs <= len(self._free_slabs):
            raise ValueError(f"cannot dedicate {num_slabs} slabs: {len(self._free_slabs)} are free")
        slabs = sorted(self._free_slabs)[-num_slabs:]
        self._free_slabs = [s for s in self._free_slabs if s not in slabs]
        for slab in slabs:
            self._slab_shape[slab] = shape
            self._slab_free[slab] = set(range(per_slab))
        self._shape_slabs[shape] = set(slabs)
        self._dedicated.add(shape)
        return slabs

    @property
    def num_free_slabs(self) -> int:
        return len(self._free_slabs)

    def allocate(self, shape: KVShape, n: int) -> list[int] | None:
        """n block ids of `shape`, or None when there is no room (nothing is taken then)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of blocks must be a non-negative integer, got {n!r}")
        per_slab = self.blocks_per_slab(shape)
        if per_slab == 0:
            raise ValueError(
                f"a block of {shape} ({shape.block_bytes} bytes) does not fit in a slab of "
                f"{self.slab_bytes} bytes"
            )
        if n == 0:
            return []
        if self.num_free_blocks(shape) < n:
            return None
        owned = self._shape_slabs.setdefault(shape, set())
        ids: list[int] = []
        # Fill the fullest slabs first, so lightly used slabs drain and return to the pool.
        for slab in sorted(owned, key=lambda s: (len(self._slab_free[s]), s)):
            ids += self._take(slab, per_slab, n - len(ids))
            if len(ids) == n:
                return ids
        while len(ids) < n:
            slab = self._free_slabs.pop()
            self._slab_shape[slab] = shape
            self._slab_free[slab] = set(range(per_slab))
            owned.add(slab)
            ids += self._take(slab, per_slab, n - len(ids))
        return ids

    def _take(self, slab: int, per_slab: int, n: int) -> list[int]:
        free = self._slab_free[slab]
        taken = sorted(free)[:n]
        free.difference_update(taken)
        return [slab * per_slab + i for i in taken]

    def free(self, shape: KVShape, block_ids) -> None:
        """Return blocks; a foreign, duplicate or already free id raises ValueError (nothing freed)."""
        block_ids = list(block_ids)
        per_slab = self.blocks_per_slab(shape)
        seen: set[int] = set()
        for g in block_ids:
            if not isinstance(g, int) or g < 0 or per_slab == 0 or g // per_slab >= self.num_slabs:
                raise ValueError(f"block id {g!r} is not in this pool for {shape}")
            slab, index = divmod(g, per_slab)
            if self._slab_shape[slab] is None:
                raise ValueError(f"block id {g} of {shape} is already free (double free): its slab is unused")
            if self._slab_shape[slab] != shape:
                raise ValueError(f"block id {g} of {shape}: slab {slab} does not hold that shape")
            if index in self._slab_free[slab] or g in seen:
                raise ValueError(f"block id {g} of {shape} is already free (double free)")
            seen.add(g)
        for g in block_ids:
            slab, index = divmod(g, per_slab)
            self._slab_free[slab].add(index)
            if len(self._slab_free[slab]) == per_slab:
                self._release_slab(shape, slab)

    def _release_slab(self, shape: KVShape, slab: int) -> None:
        if shape in self._dedicated:   # held for good
            return
        self._slab_shape[slab] = None
        self._slab_free[slab] = set()
        self._shape_slabs[shape].discard(slab)
        if not self._shape_slabs[shape]:
            del self._shape_slabs[shape]
        self._free_slabs.append(slab)
        self._free_slabs.sort(reverse=True)

    def usage(self) -> dict:
        """Occupancy stats: slabs and bytes in use, per shape and in total."""
        by_shape = {}
        used_bytes = 0
        for shape, slabs in self._shape_slabs.items():
            per_slab = self.blocks_per_slab(shape)
            used = sum(per_slab - len(self._slab_free[s]) for s in slabs)
            used_bytes += used * shape.block_bytes
            by_shape[shape] = {"num_slabs": len(slabs), "num_used_blocks": used,
                               "num_free_blocks": len(slabs) * per_slab - used}
        return {
            "num_slabs": self.num_slabs,
            "num_free_slabs": len(self._free_slabs),
            "capacity_bytes": self.num_slabs * self.slab_bytes,
            "used_bytes": used_bytes,
            "by_shape": by_shape,
        }
