"""What every KV transport shares: the descriptor, the transport interface, block copies.

    sender (prefill)                              receiver (decode)
    desc = transport.export(kv, desc)    -- desc -->   transport.import_(desc, pool, dst_block_ids)
    transport.release(desc)             <-- ack ---

The descriptor says what the blocks are (model, layout, dtype, block ids, tokens) and
where they are (transport name + handle fields); it travels as msgpack bytes, or as the
dataclass itself through a Ray call when the transport needs an ObjectRef carried
in-band (`refs`). The sender keeps the exported bytes alive until `release`; the caller
releases only after the receiver has returned from `import_`. Any failure to hand off
raises KVTransferError; the caller then recomputes the prefix.

Blocks move with `copy_block_runs`: runs of adjacent blocks become one slice each, and all
slices go in one `torch._foreach_copy_` (one fused multi-tensor copy on a GPU, one pass
over the bytes on a CPU). A gather into a temporary followed by an indexed scatter
(`index_select` + `index_copy_`) would touch every byte twice; on a CPU that measured
~10x slower than a plain memcpy for 256 MiB of bf16 blocks, the per-run copy ~1.1x.

Every copy here moves bits, not values: blocks are viewed as integers of the same width
first. `_foreach_copy_` on CUDA computes in the dtype's "opmath" type (float for bf16),
and the round trip bf16 -> float -> bf16 rewrites every NaN to one canonical NaN (0x7fff):
a handoff of random bytes once came back with 0xff where 0xf1 was sent.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch

from scheduler.kv_blocks import BLOCK_SIZE
DESCRIPTOR_VERSION = 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_HANDLE_SCALARS = (str, int, float, bool, bytes, type(None))


class KVTransferError(RuntimeError):
    """The KV of a request could not be handed off; recompute it instead."""


@dataclass(frozen=True)
class KVDescriptor:
    request_id: str
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str                       # a key of DTYPES
    block_ids: tuple[int, ...]       # the sender's block ids, in token order
    num_tokens: int
    src_node_id: str = ""
    src_worker_id: str = ""
    transport: str = ""              # set by export
    handle: dict = field(default_factory=dict)   # transport-specific, msgpack-able
    block_size: int = BLOCK_SIZE
    # ObjectRefs that must travel in-band (through Ray calls) with the descriptor; not
    # part of to_bytes(), since a ref serialized out of band is pinned forever.
    refs: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        for name in ("request_id", "model", "dtype", "src_node_id", "src_worker_id", "transport"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"KVDescriptor.{name} must be a str, got {getattr(self, name)!r}")
        if not self.request_id or not self.model:
            raise ValueError("KVDescriptor.request_id and KVDescriptor.model must be non-empty")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVDescriptor.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVDescriptor.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if isinstance(self.block_ids, list):
            object.__setattr__(self, "block_ids", tuple(self.block_ids))
        if not isinstance(self.block_ids, tuple) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.block_ids):
            raise ValueError(f"KVDescriptor.block_ids must be non-negative ints, got {self.block_ids!r}")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"KVDescriptor.block_ids has duplicates: {self.block_ids!r}")
        needed = -(-self.num_tokens // self.block_size)
        if len(self.block_ids) != needed:
            raise ValueError(f"{self.num_tokens} tokens need {needed} blocks of {self.block_size}, "
                             f"descriptor has {len(self.block_ids)}")
        if not isinstance(self.handle, dict) or not all(
                isinstance(k, str) and _msgpackable(v) for k, v in self.handle.items()):
            raise ValueError(f"KVDescriptor.handle must map str to msgpack-able values, got {self.handle!r}")
        if not isinstance(self.refs, tuple):
            raise ValueError("KVDescriptor.refs must be a tuple")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)   # [L, 2, 16, H, D]

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim \
            * self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def with_handle(self, transport: str, handle: dict, refs: tuple = ()) -> KVDescriptor:
        return dataclasses.replace(self, transport=transport, handle=handle, refs=refs)

    def to_bytes(self) -> bytes:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "refs"}
        fields["block_ids"] = list(self.block_ids)
        return msgpack.packb({"v": DESCRIPTOR_VERSION, **fields}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVDescriptor:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"KV descriptor must be bytes, got {type(data).__name__}")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:   # msgpack raises several unrelated types for bad input
            raise ValueError(f"malformed KV descriptor bytes: {exc}") from None
        if not isinstance(obj, dict) or obj.get("v") != DESCRIPTOR_VERSION:
            raise ValueError(f"not a version-{DESCRIPTOR_VERSION} KV descriptor")
        obj.pop("v")
        names = {f.name for f in dataclasses.fields(cls)} - {"refs"}
        if set(obj) - names or {"request_id", "model", "block_ids"} - set(obj):
            raise ValueError(f"KV descriptor fields {sorted(obj)} do not match {sorted(names)}")
        if isinstance(obj.get("block_ids"), list):
            obj["block_ids"] = tuple(obj["block_ids"])
        try:
            return cls(**obj)
        except TypeError as exc:
            raise ValueError(f"malformed KV descriptor: {exc}") from None


class KVTransport(ABC):
    """Sender and receiver side of one way to move KV blocks; one instance per process."""

    name: ClassVar[str]

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can run in this process (libraries and devices present)."""
        return True

    @abstractmethod
    def export(self, kv: torch.Tensor, desc: KVDescriptor, from_pool: bool = False) -> KVDescriptor:
        """Make the request's blocks readable by a receiver; return desc with its handle.

        kv: `[num_blocks, L, 2, 16, H, D]`, the request's blocks in desc.block_ids order;
        or, with from_pool, the sender's whole pool `[pool_blocks, L, 2, 16, H, D]` that
        desc.block_ids index. The blocks must not change until release(desc).
        """

    @abstractmethod
    def import_(self, desc: KVDescriptor, out: torch.Tensor | None = None,
                dst_block_ids: list[int] | None = None) -> torch.Tensor:
        """Copy the blocks into `out` and return it (a new `[num_blocks, ...]` tensor if None).

        Without dst_block_ids, out is `[num_blocks, L, 2, 16, H, D]`; with them, out is
        the receiver's pool and block i of the request lands at out[dst_block_ids[i]].
        """

    @abstractmethod
    def release(self, desc: KVDescriptor) -> None:
        """Sender side: the receiver is done with desc; free what export kept alive."""

    def close(self) -> None:
        """Free everything this instance holds (mappings, staging, handles)."""


def check_blocks(kv: torch.Tensor, desc: KVDescriptor, from_pool: bool,
                 block_ids: tuple[int, ...] | list[int] | None = None) -> None:
    """Reject a tensor whose layout does not match the descriptor, naming the mismatch.

    With from_pool, kv is a whole pool and `block_ids` (default: the descriptor's) index it."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"KV blocks must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 6 or tuple(kv.shape[1:]) != desc.block_shape:
        raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not match the descriptor's "
                         f"[n, {', '.join(map(str, desc.block_shape))}]")
    if kv.dtype != desc.torch_dtype:
        raise ValueError(f"KV blocks are {kv.dtype}, the descriptor says {desc.dtype}")
    if from_pool:
        ids = desc.block_ids if block_ids is None else block_ids
        if min(ids) < 0 or max(ids) >= kv.shape[0]:
            raise ValueError(f"block ids {min(ids)}..{max(ids)} are outside a pool of {kv.shape[0]} blocks")
        if len(set(ids)) != len(ids):
            raise ValueError(f"block ids have duplicates: {list(ids)}")
    elif kv.shape[0] != desc.num_blocks:
        raise ValueError(f"{kv.shape[0]} blocks given, the descriptor has {desc.num_blocks}")
    if not kv[0].is_contiguous():
        raise ValueError("each KV block must be contiguous (layout [n, L, 2, 16, H, D])")


def block_pointers(kv: torch.Tensor, block_ids: tuple[int, ...] | list[int] | None) -> list[int]:
    """The address of each block of `kv` `[n, L, 2, 16, H, D]` (those `block_ids` of a pool, or
    all of them in order), from its base and block stride: no tensor per block (an export of
    128 blocks spent ~0.5 ms making and reading 128 views)."""
    stride = kv.stride(0) * kv.element_size()
    ids = range(kv.shape[0]) if block_ids is None else block_ids
    return [kv.data_ptr() + i * stride for i in ids]


def destination(desc: KVDescriptor, out: torch.Tensor | None,
                dst_block_ids: list[int] | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Validate (or allocate) the tensor import_ writes into."""
    if out is None:
        if dst_block_ids is not None:
            raise ValueError("dst_block_ids needs the destination pool as out")
        return torch.empty((desc.num_blocks, *desc.block_shape), dtype=desc.torch_dtype, device=device)
    if dst_block_ids is not None:
        if len(dst_block_ids) != desc.num_blocks:
            raise ValueError(f"{len(dst_block_ids)} destination blocks for {desc.num_blocks} source blocks")
        check_blocks(out, desc, from_pool=True, block_ids=dst_block_ids)
    else:
        check_blocks(out, desc, from_pool=False)
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width (same shape and strides): copied
    without any arithmetic, so every bit pattern, NaN payloads included, survives."""
    return t.view(_BITS[t.element_size()])


def block_runs(src_index: list[int], dst_index: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src start, dst start, length) where both indices advance by one."""
    if len(src_index) != len(dst_index):
        raise ValueError(f"{len(src_index)} source blocks but {len(dst_index)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_index, dst_index):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_block_runs(dst: torch.Tensor, dst_index: list[int], src: torch.Tensor, src_index: list[int],
                    method: str | None = None) -> None:
    """dst[dst_index[i]] = src[src_index[i]] for grids `[n, L, 2, 16, H, D]`, as one vectorised copy.

    method "runs" (a CPU's default, and any single run): one `_foreach_copy_` over the runs.
    method "index" (a GPU's default for several runs): index kernels over block rows, as one
    pass where either side is a plain range, else a gather then a scatter. On an H200 the
    multi-tensor copy of 128 scattered 2 MiB blocks ran at ~200 GB/s, a tenth of a device
    copy: it splits every tensor into small chunks. Both methods are bit-exact."""
    runs = block_runs(src_index, dst_index)
    if not runs:
        return
    dst, src = as_bits(dst), as_bits(src)
    if method is None:
        method = "index" if dst.device.type == "cuda" and len(runs) > 1 else "runs"
    if method == "runs":
        torch._foreach_copy_([dst[d:d + n] for _, d, n in runs], [src[s:s + n] for s, _, n in runs])
    elif method == "index":
        _copy_block_rows(dst, dst_index, src, src_index)
    else:
        raise ValueError(f"method must be 'runs' or 'index', got {method!r}")


def _copy_block_rows(dst: torch.Tensor, dst_index: list[int], src: torch.Tensor, src_index: list[int]) -> None:
    """The "index" method: each block as one row (its blocks are contiguous, so a view)."""
    dst_rows, src_rows = dst.view(dst.shape[0], -1), src.view(src.shape[0], -1)
    n, device = len(src_index), dst.device
    if src_index == list(range(src_index[0], src_index[0] + n)):      # a contiguous source
        dst_rows.index_copy_(0, torch.tensor(dst_index, device=device), src_rows[src_index[0]:src_index[0] + n])
        return
    gather = torch.tensor(src_index, device=device)
    target = dst_rows[dst_index[0]:dst_index[0] + n]
    if dst_index == list(range(dst_index[0], dst_index[0] + n)) and target.is_contiguous():
        torch.index_select(src_rows, 0, gather, out=target)            # a contiguous destination
        return
    dst_rows.index_copy_(0, torch.tensor(dst_index, device=device), src_rows.index_select(0, gather))


def gather_blocks(pool: torch.Tensor, block_ids: tuple[int, ...] | list[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """pool[block_ids] as a new (or the given) `[n, L, 2, 16, H, D]` tensor, one vectorised copy."""
    if out is None:
        out = torch.empty((len(block_ids), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    copy_block_runs(out, list(range(len(block_ids))), pool, list(block_ids))
    return out


def copy_into(out: torch.Tensor, src: torch.Tensor, dst_block_ids: list[int] | None) -> None:
    """out[...] = src `[num_blocks, L, 2, 16, H, D]`: all of out, or the pool blocks dst_block_ids."""
    if dst_block_ids is None:
        out.copy_(src)
    else:
        copy_block_runs(out, dst_block_ids, src.to(out.device, non_blocking=True), list(range(len(dst_block_ids))))


def copy_from_offsets(src: torch.Tensor, offsets: list[int], desc: KVDescriptor, out: torch.Tensor,
                      dst_block_ids: list[int] | None) -> None:
    """Copy the blocks at byte `offsets` of `src` (uint8 `[nbytes]`) into out, block i to out[i] (or out[dst_block_ids[i]]).

    Blocks on a common block grid (the sender's pool, a staging file) are read through that
    grid, so adjacent blocks merge into runs; anything else goes block by block, still in
    one vectorised call.
    """
    bb, lo = desc.block_bytes, min(offsets)
    dst_index = list(range(len(offsets))) if dst_block_ids is None else list(dst_block_ids)
    if all((off - lo) % bb == 0 for off in offsets):
        span = (max(offsets) - lo) // bb + 1
        grid = src[lo:lo + span * bb].view(desc.torch_dtype).view(span, *desc.block_shape)
        copy_block_runs(out, dst_index, grid, [(off - lo) // bb for off in offsets])
        return
    blocks = [src[off:off + bb].view(desc.torch_dtype).view(desc.block_shape) for off in offsets]
    bits = as_bits(out)
    torch._foreach_copy_([bits[d] for d in dst_index], [as_bits(b) for b in blocks])


def _msgpackable(value) -> bool:
    if isinstance(value, _HANDLE_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_msgpackable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _msgpackable(v) for k, v in value.items())
    return False
