"""Forming a placement plan's tensor-parallel group on its workers (scheduler/tp_groups.py
chooses them; actors/tp_group.py and actors/tp_member.py run them).

    form_group(model, path, group, handles)

0. a worker still in a group one of whose workers is gone (died, replaced) leaves it first:
   the requests its leader holds wait there (Engine.strand) and go on at step 3;
1. every worker of `group` (leader first) joins one TPGroup, rank = its place in `group`,
   at a loopback address free on the leader's node (a group never spans nodes); a worker
   already in exactly this group stays in it, so a second model on the same workers reuses it;
2. the members (ranks 1..N-1) register their part of the model (`register_tp_model`);
3. then the leader registers its part with the members' handles: from then on its steps
   reach them, and they already hold the model.

A process holds one torch.distributed group, so a worker of another group cannot join
this one: that is refused, and the placement service takes the group out of its plan.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any


async def form_group(model: str, path: str, group: Sequence[str], handles: Mapping[str, Any]) -> None:
    """Make `model` servable by `group` (worker ids, leader first); raises ValueError naming
    the worker that cannot take part, or the worker's own error."""
    from actors.tensor_parallel import TPShard   # torch comes with it: the placement service imports light

    group = tuple(group)
    absent = [w for w in group if w not in handles]
    if absent:
        raise ValueError(f"tensor-parallel group {group} of {model!r}: workers {absent} are not live")
    workers = [handles[w] for w in group]
    joined = await asyncio.gather(*(h.tp_group_workers.remote() for h in workers))
    if any(tuple(j) != group for j in joined):
        # a group one of whose workers is gone is left (its leader's requests wait for the new one)
        broken = [h for h, j in zip(workers, joined) if j and not set(j) <= set(handles)]
        await asyncio.gather(*(h.leave_tp_group.remote() for h in broken))
        others = [(w, tuple(j)) for w, j in zip(group, joined) if j and set(j) <= set(handles) and tuple(j) != group]
        if others:
            w, other = others[0]
            raise ValueError(f"worker {w} already belongs to tensor-parallel group {other}; "
                             f"{model!r} needs {group}")
        address = await workers[0].tp_address.remote()
        await asyncio.gather(*(h.join_tp_group.remote(TPShard(rank, len(group)), address, group)
                               for rank, h in enumerate(workers)))
    await asyncio.gather(*(h.register_tp_model.remote(model, path) for h in workers[1:]))
    await workers[0].register_tp_model.remote(model, path, workers[1:])
