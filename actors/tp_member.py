"""The members of a tensor-parallel group (ranks 1..N-1) and how their leader drives them.

The leader (rank 0) is an ordinary engine whose policy schedules the model; each member is a
`TPMember` Ray actor with an engine of its own that never schedules. For every step of the
model the leader's engine sends a `TPStep` (actors/tp_group.py) to each member with a plain
Ray actor call, runs its own part, and waits for theirs: calls from one caller run on an
actor in the order they were sent, so every rank runs the same forwards in the same order and
their all-reduces pair up. A member's engine has the leader's EngineConfig, so its KV pool
has the leader's geometry and the leader's block ids mean the same blocks there.
"""
from __future__ import annotations

import logging

import ray

from actors.engine import Engine, EngineConfig
from actors.tensor_parallel import TPShard
from actors.tp_group import TPGroup, TPStep
from scheduler.messages import RegisteredModel

logger = logging.getLogger(__name__)


class TPMembers:
    """The leader's handles on its group's members, in rank order (1..N-1)."""

    def __init__(self, handles: list):
        if not handles:
            raise ValueError("a tensor-parallel group needs at least one member besides its leader")
        self.handles = list(handles)

    def send(self, step: TPStep) -> list:
        """Start `step` on every member; returns what `wait` takes."""
        return [h.follow.remote(step) for h in self.handles]

    def wait(self, sent: list) -> None:
        """Until every member has run its step (raises a member's error)."""
        ray.get(sent)


class TPMember:
    """Rank `shard.rank` > 0 of a group, run as a Ray actor (`ray.remote(TPMember)`, one device
    each): joins the group at `address` as it starts, so its leader must be joining too."""

    def __init__(self, config: EngineConfig, shard: TPShard, address: str):
        if shard.rank == 0:
            raise ValueError("rank 0 is the group's leader, not a member")
        self.group = TPGroup(shard, address, config.device)
        self.engine = Engine(config)

    def register_model(self, name: str, path: str) -> RegisteredModel:
        return self.engine.register_model(name, path, group=self.group)

    def follow(self, step: TPStep) -> None:
        self.engine.follow(step)

    def close(self) -> None:
        self.group.close()
