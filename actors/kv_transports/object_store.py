"""Cross-node KV handoff through the Ray object store.

The sender puts the blocks' bytes (one uint8 array, so bfloat16 travels too) and owns
the object. The ObjectRef rides in `desc.refs`, so the descriptor must go to the
receiver as a Python object through a Ray call: Ray then serializes the ref in-band and
counts the receiver as a borrower. (A ref pickled out of band would be pinned for the
life of the sender; msgpack bytes of the descriptor carry only the object id, for logs.)
The object is freed once the sender has released it and the receiver has dropped desc.
"""
from __future__ import annotations

import logging
import warnings

import torch

from actors.kv_transports.base import KVDescriptor, KVTransferError, KVTransport, check_blocks, copy_into, destination, gather_blocks

logger = logging.getLogger(__name__)

DEFAULT_GET_TIMEOUT_S = 60.0


class ObjectStoreTransport(KVTransport):
    name = "object_store"

    def __init__(self, get_timeout_s: float = DEFAULT_GET_TIMEOUT_S):
        if get_timeout_s <= 0:
            raise ValueError(f"get_timeout_s must be positive, got {get_timeout_s!r}")
        self.get_timeout_s = get_timeout_s
        self._exports: dict[str, object] = {}   # request_id -> ObjectRef the sender owns

    @classmethod
    def available(cls) -> bool:
        try:
            import ray
        except ImportError:
            return False
        return ray.is_initialized()

    def export(self, kv: torch.Tensor, desc: KVDescriptor, from_pool: bool = False) -> KVDescriptor:
        import ray

        check_blocks(kv, desc, from_pool)
        if desc.request_id in self._exports:
            raise ValueError(f"request {desc.request_id!r} is already exported and not released")
        if from_pool:
            kv = gather_blocks(kv, desc.block_ids)
        flat = kv.detach().to("cpu").contiguous().view(-1).view(torch.uint8)   # [nbytes]
        try:
            ref = ray.put(flat.numpy())
        except Exception as exc:   # object store full, not connected, ...
            raise KVTransferError(f"cannot put KV of request {desc.request_id!r}: {exc}") from exc
        self._exports[desc.request_id] = ref
        handle = {"object_id": ref.hex(), "nbytes": desc.nbytes}
        return desc.with_handle(self.name, handle, refs=(ref,))

    def import_(self, desc: KVDescriptor, out: torch.Tensor | None = None,
                dst_block_ids: list[int] | None = None) -> torch.Tensor:
        import ray

        out = destination(desc, out, dst_block_ids)
        if desc.transport != self.name:
            raise ValueError(f"descriptor is for transport {desc.transport!r}, not {self.name!r}")
        if len(desc.refs) != 1 or desc.refs[0].hex() != desc.handle.get("object_id"):
            raise KVTransferError(
                f"descriptor of request {desc.request_id!r} carries no ObjectRef: pass the KVDescriptor "
                "itself through the Ray call, not its bytes")
        try:
            data = ray.get(desc.refs[0], timeout=self.get_timeout_s)   # zero-copy, read-only
        except Exception as exc:   # owner died, object lost, timeout
            raise KVTransferError(f"KV of request {desc.request_id!r} is gone from the object store: {exc}") \
                from exc
        if data.nbytes != desc.nbytes:
            raise KVTransferError(f"object holds {data.nbytes} bytes, descriptor says {desc.nbytes}")
        with warnings.catch_warnings():   # we only read from it
            warnings.filterwarnings("ignore", message=".*not writable.*")
            src = torch.from_numpy(data)
        copy_into(out, src.view(desc.torch_dtype).view(desc.num_blocks, *desc.block_shape), dst_block_ids)
        return out

    def release(self, desc: KVDescriptor) -> None:
        if self._exports.pop(desc.request_id, None) is None:
            raise ValueError(f"request {desc.request_id!r} was not exported by this transport")

    def close(self) -> None:
        self._exports.clear()
