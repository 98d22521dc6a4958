"""A tensor-parallel group's collectives: one process per rank, over `torch.distributed`.

Each rank's process makes one `TPGroup`, which owns the process group of its ranks: NCCL
between CUDA devices, gloo between the virtual devices of a CPU host. Its `all_reduce`
(a sum, in place) is the model runner's hook after attention and after the MLP
(actors/model_runner.py). Every rank must run the same forwards in the same order: the
group's leader decides each step and the members follow it (actors/tp_member.py).

One group per process: `torch.distributed`'s default group is the group's.

`TPStep` is what the leader sends each member (actors/tp_member.py) for each forward of a
tensor-parallel model, in the order it runs them: the KV copies of that model's requests
(swaps), then the forward's chunks (the same batch, positions and KV block ids: the members'
pools have the leader's geometry, so a block id names the same block on every rank).
"""
from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from actors.model_runner import SeqChunk
from actors.tensor_parallel import TPShard
from scheduler.scheduler_output import KVCopy

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0   # every rank must join within this; a collective waits as long for the others


@dataclass(frozen=True)
class TPStep:
    """One step of a tensor-parallel model on the leader, for its members to repeat: weights
    resident, then the KV copies (device -> host, then host -> device), then the forward of
    `chunks` when there are any."""

    model: str
    swap_out: tuple[KVCopy, ...] = ()
    swap_in: tuple[KVCopy, ...] = ()
    chunks: tuple[SeqChunk, ...] = ()
    is_prefill: bool = False   # for the member's timeline
    tbt_slo_s: float = 0.0     # the tightest TBT SLO of the forward's requests: a member's rounds count the group by it


def backend_for(device: torch.device | str) -> str:
    """The collectives' backend between devices of this kind: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_address(host: str = "127.0.0.1") -> str:
    """A tcp:// address on a port free now, for the group's rendezvous (rank 0 listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class TPGroup:
    def __init__(self, shard: TPShard, address: str, device: torch.device | str = "cpu",
                 timeout_s: float = INIT_TIMEOUT_S):
        """Join the group at `address` (from `free_address`, the same for every rank); returns
        once every rank has joined."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        self.shard = shard
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        dist.init_process_group(self.backend, init_method=address, rank=shard.rank, world_size=shard.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("tensor-parallel rank %d of %d joined over %s (%s)", shard.rank, shard.size, self.backend,
                    address)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """# [T, hidden] partial sums of this rank -> the group's sum, in place."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
