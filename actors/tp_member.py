"""How a tensor-parallel group's leader drives its members (ranks 1..N-1).

The leader (rank 0) is a DeviceWorker whose engine's policy schedules the model; each member
is a DeviceWorker too, with the model's part registered (`register_tp_model`). For every step
of the model the leader's engine sends a `TPStep` (actors/tp_group.py) to each member's
`follow` with a plain Ray actor call, runs its own part, and waits for theirs. Calls from
one caller run on an actor in the order they were sent, and a member runs each on its engine
thread between its own steps, so every rank runs the same forwards in the same order and
their all-reduces pair up. A member's engine has the leader's EngineConfig, so its KV pool
has the leader's geometry and the leader's block ids mean the same blocks there.
"""
from __future__ import annotations

import ray
from ray.exceptions import RayActorError

from actors.fault_isolation import GroupLost
from actors.tp_group import TPStep


class TPMembers:
    """The leader's handles on its group's members (DeviceWorkers), in rank order (1..N-1)."""

    def __init__(self, handles: list):
        if not handles:
            raise ValueError("a tensor-parallel group needs at least one member besides its leader")
        self.handles = list(handles)

    def send(self, step: TPStep) -> list:
        """Start `step` on every member; returns what `wait` takes."""
        return [h.follow.remote(step) for h in self.handles]

    def wait(self, sent: list) -> None:
        """Until every member has run its step (raises a member's error; GroupLost when one is gone)."""
        self._all(sent)

    # ---- a KV handoff of the group's model (actors/tp_handoff.py): each member its own shard ----

    def export_shards(self, request_id: str, model: str, block_ids: tuple[int, ...], num_tokens: int,
                      dst_node_id: str) -> list:
        """Each member's KVDescriptor of its shard of these blocks, in rank order (1..N-1). When
        one fails, the others' exports are released before its error is raised."""
        refs = [h.export_kv_shard.remote(request_id, model, tuple(block_ids), num_tokens, dst_node_id)
                for h in self.handles]
        exported, failure = [], None
        for handle, ref in zip(self.handles, refs):
            try:
                exported.append((handle, ray.get(ref)))
            except Exception as exc:   # KVTransferError, a member gone, ...
                failure = failure or exc
        if failure is None:
            return [desc for _, desc in exported]
        for handle, desc in exported:
            handle.release_kv_shard.remote(desc)
        if isinstance(failure, RayActorError):
            raise GroupLost(f"a member of the tensor-parallel group is gone: {str(failure).splitlines()[0]}") \
                from failure
        raise failure

    def import_shards(self, shards, block_ids: tuple[int, ...]) -> None:
        """Member r copies shards[r - 1] into its blocks `block_ids` (the ids its leader allocated)."""
        self._all([h.import_kv_shard.remote(s, tuple(block_ids)) for h, s in zip(self.handles, shards, strict=True)])

    def release_shards(self, shards) -> None:
        """The receiver has every shard (or gave up): each member frees what its export kept alive."""
        self._all([h.release_kv_shard.remote(s) for h, s in zip(self.handles, shards, strict=True)])

    def _all(self, refs: list) -> list:
        try:
            return ray.get(refs)
        except RayActorError as exc:
            raise GroupLost(f"a member of the tensor-parallel group is gone: {str(exc).splitlines()[0]}") from exc
