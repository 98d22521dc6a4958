"""Tensor-parallel groups in placement: how many devices a model asks for, and which ones.

A model declared with `tensor_parallel: N` is served by a group of N workers (one device
each) on ONE node: a step all-reduces across the group twice per layer, which the
node's device link carries and the network between nodes would not. Each member holds
1/N of the weights and of the KV per token, so the per-device share, not the whole
model, must fit a worker's slot. The group's first worker is its leader: it runs the
scheduler and takes the model's requests (the router sends them there only); the others
run the same steps. Devices of a group still serve single-device models between its
turns (token-level switching), so a group is never a reservation of whole devices.

N is a power of two (attention heads and KV heads split evenly only then, for the
families served) that divides the node's device count (so groups tile a node).
"""
from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def check_tensor_parallel(value: Any, devices_per_node: int | None = None, model: str = "") -> int:
    """`value` as a degree, or ValueError naming `tensor_parallel` (and the model)."""
    who = f"model {model!r}: " if model else ""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}tensor_parallel must be a positive int, got {value!r}")
    if value & (value - 1):
        raise ValueError(f"{who}tensor_parallel must be a power of two (1, 2, 4, 8), got {value}")
    if devices_per_node is not None and devices_per_node % value:
        raise ValueError(f"{who}tensor_parallel {value} does not divide the node's {devices_per_node} devices")
    return value


def device_share(nbytes: int, tensor_parallel: int) -> int:
    """What one member of a group holds of `nbytes` split N ways (rounded up)."""
    return -(-nbytes // tensor_parallel)


def min_tensor_parallel(weight_bytes: int, device_bytes: int, max_degree: int = 64) -> int | None:
    """The smallest power of two whose share of `weight_bytes` fits `device_bytes` (None: none up to max_degree)."""
    n = 1
    while n <= max_degree:
        if device_share(weight_bytes, n) <= device_bytes:
            return n
        n *= 2
    return None


def check_fits_device(model: str, weight_bytes: int, tensor_parallel: int, device_bytes: int) -> None:
    """ValueError naming `tensor_parallel` when the model's per-device share exceeds `device_bytes`."""
    share = device_share(weight_bytes, tensor_parallel)
    if share <= device_bytes:
        return
    need = min_tensor_parallel(weight_bytes, device_bytes)
    fix = f"set tensor_parallel: {need}" if need else "no tensor_parallel degree up to 64 fits it"
    raise ValueError(f"model {model!r}: weights of {weight_bytes} bytes at tensor_parallel {tensor_parallel} "
                     f"put {share} bytes on each device, more than one device's weight slot "
                     f"({device_bytes} bytes); {fix}")


def choose_group(size: int, share_bytes: int, workers: Sequence[Any], previous: Sequence[str] = (),
                 cached_nodes: Iterable[str] = (), members: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """`size` distinct workers of one node, each with a slot of at least `share_bytes`,
    leader first; () when no node has that many.

    `workers`: WorkerView-like (worker_id, node_id, slot_bytes), all live. The previous
    group stays while it still qualifies (nothing moves without cause); else a node whose
    host cache has the model is preferred, then the node and workers carrying the fewest
    group members already (`members`: worker -> groups it is in), so groups spread."""
    fit = {w.worker_id: w for w in workers if w.slot_bytes >= share_bytes}
    if len(previous) == size and all(w in fit for w in previous) \
            and len({fit[w].node_id for w in previous}) == 1:
        return tuple(previous)
    members = members or {}
    cached = set(cached_nodes)
    by_node: dict[str, list[str]] = {}
    for wid in sorted(fit):
        by_node.setdefault(fit[wid].node_id, []).append(wid)
    options = []
    for node, ids in by_node.items():
        if len(ids) < size:
            continue
        chosen = sorted(ids, key=lambda w: (members.get(w, 0), w))[:size]
        options.append((node not in cached, sum(members.get(w, 0) for w in chosen), node, tuple(chosen)))
    return min(options)[3] if options else ()


def place_groups(workers: Sequence[Any], models: Mapping[str, Any], cached_on_node: Mapping[str, set[str]],
                 previous: Mapping[str, tuple[str, ...]], unplaceable: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """A group for each model of `models` (ModelInfo-like: tensor_parallel, device_weight_bytes;
    busiest first) whose degree is above 1, on the live `workers`, spread over the nodes;
    `previous`: last plan's groups (sticky). A model no node can hold goes to `unplaceable`."""
    groups: dict[str, tuple[str, ...]] = {}
    members: collections.Counter = collections.Counter()
    for m, info in models.items():
        if info.tensor_parallel == 1:
            continue
        group = choose_group(info.tensor_parallel, info.device_weight_bytes, workers, previous.get(m, ()),
                             (node for node, cached in cached_on_node.items() if m in cached), members)
        if not group:
            unplaceable[m] = (f"tensor_parallel {info.tensor_parallel} needs {info.tensor_parallel} workers "
                              f"on one node with slots of >= {info.device_weight_bytes} bytes; no node has them")
            continue
        groups[m] = group
        members.update(group)
    return groups
