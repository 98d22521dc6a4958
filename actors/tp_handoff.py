"""KV handoff of a tensor-parallel model: each rank's shard goes to the matching rank.

A TP model's KV cache is split by KV heads (actors/tensor_parallel.py): rank r of a group
holds heads [r * Hkv/N, (r+1) * Hkv/N) of every block, and the group's block ids are the
leader's decision, the same on every rank (its slabs are dedicated alike on each). So a
handoff from a prefill group to a decode group is N ordinary handoffs, one per rank, over
the same transports (actors/kv_transfer.py), with the same block ids on each side:

    prefill leader (rank 0)                         decode leader (rank 0)
    detach; export shard 0; members export 1..N-1   adopt(state, fill): blocks allocated here,
      -- GroupKVDescriptor on the decode dispatch -->  fill: import shard 0; members import 1..N-1
    release shard 0; members release theirs    <-- ack --                     into the same ids

The decode leader adopts through the engine's one adopt path (`Engine.adopt` with a fill);
its members never schedule, so they only copy their shard into the blocks the leader chose.
A layout that does not match (another TP degree, another head split, a single-device model
on one side) is refused with its reason before any copy: the request recomputes its prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.kv_transports.base import KVDescriptor


@dataclass(frozen=True)
class GroupKVDescriptor:
    """The KV of one request of a TP model: one KVDescriptor per rank, in rank order."""

    shards: tuple[KVDescriptor, ...]

    def __post_init__(self) -> None:
        if isinstance(self.shards, list):
            object.__setattr__(self, "shards", tuple(self.shards))
        if len(self.shards) < 2 or not all(isinstance(s, KVDescriptor) for s in self.shards):
            raise ValueError(f"a group's KV needs a KVDescriptor per rank (>= 2), got {self.shards!r}")
        first = self.shards[0]
        for rank, shard in enumerate(self.shards[1:], 1):
            if (shard.request_id, shard.model, shard.num_tokens, shard.block_ids, shard.num_layers, shard.num_kv_heads,
                    shard.head_dim, shard.dtype) != (first.request_id, first.model, first.num_tokens, first.block_ids,
                                                     first.num_layers, first.num_kv_heads, first.head_dim, first.dtype):
                raise ValueError(f"KV shard of rank {rank} of {first.request_id!r} does not match rank 0's "
                                 f"(request, model, tokens, block ids and per-rank layout are the same on every rank)")

    @property
    def request_id(self) -> str:
        return self.shards[0].request_id

    @property
    def model(self) -> str:
        return self.shards[0].model

    @property
    def num_tokens(self) -> int:
        return self.shards[0].num_tokens

    @property
    def size(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def layout_mismatch(desc: KVDescriptor | GroupKVDescriptor, size: int, num_kv_heads: int, num_layers: int,
                    head_dim: int) -> str | None:
    """Why `desc` cannot fill the KV of a model here split over `size` ranks, each holding
    `num_kv_heads` KV heads of `num_layers` x `head_dim`; None when it can."""
    sent = desc.size if isinstance(desc, GroupKVDescriptor) else 1
    if sent != size:
        return (f"KV of {desc.request_id!r} is split over {sent} rank(s), this model over {size}: "
                f"a shard has no matching rank")
    shard = desc.shards[0] if isinstance(desc, GroupKVDescriptor) else desc
    if (shard.num_layers, shard.num_kv_heads, shard.head_dim) != (num_layers, num_kv_heads, head_dim):
        return (f"KV of {desc.request_id!r} holds {shard.num_kv_heads} KV heads x {shard.head_dim} of "
                f"{shard.num_layers} layers per rank; a rank here holds {num_kv_heads} x {head_dim} of {num_layers}")
    return None
