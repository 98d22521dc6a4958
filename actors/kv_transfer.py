"""KV transfer between two workers' pools: which transport, and the export/import steps.

    sender (prefill)                                 receiver (decode)
    desc = transfers.export(rid, model, blocks, ..)  -- desc rides on the decode dispatch -->
                                                     transfers.import_(desc, its blocks)
    transfers.release(desc)                          <-- ack --

| where                 | transport                 | copies                                   |
|-----------------------|---------------------------|------------------------------------------|
| same node, GPU        | CudaIPCTransport          | one, GPU to GPU, ordered by an IPC event |
| same node, CPU host   | SharedMemoryTransport     | one out of a shared KV region, else two  |
| across nodes          | ObjectStoreTransport      | into the object store, out on the other  |

The transports themselves are in actors/kv_transports/ (the descriptor and the interface
in base.py); this module picks one per pair of workers and moves `KVBlocks` (a request's
blocks inside a pool) through it. Any failure to hand off raises KVTransferError; the
caller then recomputes the prefix.
"""
from __future__ import annotations

from actors.kv_pool import KVBlocks
from actors.kv_transports.base import KVDescriptor, KVTransferError, KVTransport
from actors.kv_transports.cuda_ipc import CudaIPCTransport
from actors.kv_transports.object_store import ObjectStoreTransport
from actors.kv_transports.shared_memory import SharedMemoryTransport

TRANSPORTS: dict[str, type[KVTransport]] = {
    t.name: t for t in (SharedMemoryTransport, ObjectStoreTransport, CudaIPCTransport)}


def choose_transport(src_node: str, dst_node: str, device_kind: str) -> str:
    """The transport name for a handoff between two workers (device_kind: "cuda" or "cpu")."""
    if device_kind not in ("cuda", "cpu"):
        raise ValueError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    if src_node != dst_node:
        return "object_store"
    if device_kind == "cuda" and CudaIPCTransport.available():
        return "cuda_ipc"
    return "shm"


def make_transport(name: str, **kwargs) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](**kwargs)


class KVTransfers:
    """One per worker process: its transports (made on first use) and the KV export/import steps.

    Both steps run where the pool cannot change under them (a worker's engine thread, between steps).
    """

    def __init__(self, worker_id: str, node_id: str, device_kind: str):
        self.worker_id = worker_id
        self.node_id = node_id
        self.device_kind = device_kind
        self.transports: dict[str, KVTransport] = {}

    def transport(self, name: str) -> KVTransport:
        if name not in self.transports:
            self.transports[name] = make_transport(name)
        return self.transports[name]

    def shared_kv_region(self, nbytes: int):
        """A node-shared uint8 buffer `[nbytes]` for the KV pool: shm handoffs then export without a copy."""
        return self.transport("shm").allocate_region(nbytes)

    def export(self, request_id: str, model: str, blocks: KVBlocks, num_tokens: int,
               dst_node_id: str) -> KVDescriptor:
        """Make `blocks` readable by a worker on dst_node_id; they must not change until release."""
        layers, _, _, kv_heads, head_dim = blocks.block_shape
        desc = KVDescriptor(request_id, model, layers, kv_heads, head_dim, blocks.dtype_name, blocks.block_ids,
                            num_tokens, src_node_id=self.node_id, src_worker_id=self.worker_id)
        transport = self.transport(choose_transport(self.node_id, dst_node_id, self.device_kind))
        grid = blocks.grid
        if grid is not None:
            return transport.export(grid, desc, from_pool=True)
        return transport.export(blocks.gather(), desc)

    def import_(self, desc: KVDescriptor, blocks: KVBlocks) -> None:
        """Copy the descriptor's KV into `blocks` (ids allocated here, one per descriptor block)."""
        if (desc.num_layers, 2, desc.block_size, desc.num_kv_heads, desc.head_dim) != blocks.block_shape \
                or desc.dtype != blocks.dtype_name:
            raise ValueError(f"KV of {desc.request_id!r} is [{desc.num_layers}, 2, {desc.block_size}, "
                             f"{desc.num_kv_heads}, {desc.head_dim}] {desc.dtype}; this pool holds "
                             f"{list(blocks.block_shape)} {blocks.dtype_name}")
        transport = self.transport(desc.transport)
        grid = blocks.grid
        if grid is not None:
            transport.import_(desc, out=grid, dst_block_ids=list(blocks.block_ids))
        else:
            blocks.scatter(transport.import_(desc))

    def release(self, desc: KVDescriptor) -> None:
        """Sender side: the receiver has the KV (or gave up); free what export kept alive."""
        self.transport(desc.transport).release(desc)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


__all__ = ["CudaIPCTransport", "KVBlocks", "KVDescriptor", "KVTransferError", "KVTransfers", "KVTransport",
           "ObjectStoreTransport", "SharedMemoryTransport", "TRANSPORTS", "choose_transport",
           "make_transport"]
