"""CUDA graphs of the decode forward: one launch per step instead of one per kernel.

A decode step of a 7B model is ~500 small kernels; at batch 1 their launch overhead is
as long as reading the weights. A graph is captured for each (weights in a slot, KV
pool, batch bucket, block bucket): batch sizes round up to `BATCH_BUCKETS` and the
blocks per sequence to a power of two, so a handful of graphs per resident model cover
every decode batch; the runner pads its index tensors to the bucket (the padding
repeats real rows, whose KV writes are then the same values). A prefill, or a batch
past the largest bucket, runs eagerly. The runner applies graphs in one place
(`ModelRunner.forward`); nothing else knows about them.

A graph is captured on the first decode step of its bucket (weights must be resident
and the pool known; both are fixed afterwards: slots and the pool are allocated once),
replayed from then on, and all graphs share one memory pool. Should a capture fail,
that bucket runs eagerly from then on (logged once): never a wrong token, at worst the
eager speed.

The bookkeeping around the graphs (buckets, padding, the static buffers and the per-step
copy into them) is device-independent, so it runs and is tested on a CPU: there a
"graph" is `_EagerReplay`, which re-runs the forward over the same static buffers. The
per-step copy is what once broke every CUDA decode (a stride-0 mask view as a static
buffer: `copy_` refuses a destination whose elements overlap), and it fails on a CPU the
same way, so CPU tests catch that class of bug.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import fields

import torch

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MAX_GRAPHS = 128   # per runner; the oldest is dropped past this (its memory returns to the shared pool)


class _EagerReplay:
    """A CPU stand-in for a captured graph: replay runs the forward again over the very same
    static buffers and writes into the same output tensor, as a graph replay does."""

    def __init__(self, run):
        self._run = run
        self.output = run()

    def replay(self) -> None:
        self.output.copy_(self._run())


class DecodeGraphs:
    def __init__(self, forward_step, device: torch.device, max_blocks: int = 1 << 12):
        """forward_step(params, step, kv) -> logits: the runner's tensor-only forward. On a CPU
        device the graphs are emulated (`_EagerReplay`): same bookkeeping, eager arithmetic."""
        self.forward_step = forward_step
        self.device = device
        self.max_blocks = max_blocks
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()   # key -> (graph, static step, static logits)
        self._failed: set[tuple] = set()
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.num_replays = 0

    def bucket(self, chunks) -> tuple[int, int] | None:
        """(batch, blocks per sequence) to pad a decode step to, or None to run it eagerly."""
        if len(chunks) > BATCH_BUCKETS[-1] or any(len(c.token_ids) != 1 for c in chunks):
            return None
        blocks = max(c.start_pos // 16 + 1 for c in chunks)
        if blocks > self.max_blocks:
            return None
        batch = next(b for b in BATCH_BUCKETS if b >= len(chunks))
        return batch, 1 << (blocks - 1).bit_length()

    def replay(self, params: dict, step, kv: torch.Tensor, bucket: tuple[int, int]) -> torch.Tensor:
        """Logits of the padded step, from its graph (captured now if new)."""
        key = (id(params), kv.data_ptr(), tuple(kv.shape), *bucket)
        if key in self._failed:
            return self.forward_step(params, step, kv)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, params, step, kv)
            if entry is None:
                return self.forward_step(params, step, kv)
        else:
            self._graphs.move_to_end(key)
            _copy_step(entry[1], step)
        graph, _, logits = entry
        graph.replay()
        self.num_replays += 1
        return logits

    def _capture(self, key: tuple, params: dict, step, kv: torch.Tensor):
        if self.device.type != "cuda":
            graph = _EagerReplay(lambda: self.forward_step(params, step, kv))
            return self._keep(key, graph, step, graph.output)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):   # warm-up: lazy inits and cuBLAS workspaces outside the graph
                    self.forward_step(params, step, kv)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.forward_step(params, step, kv)   # step's tensors become the static inputs
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed for batch %d, %d blocks (%s); that bucket runs eagerly",
                           key[-2], key[-1], exc)
            self._failed.add(key)
            return None
        return self._keep(key, graph, step, logits)

    def _keep(self, key: tuple, graph, step, logits: torch.Tensor):
        self._graphs[key] = (graph, step, logits)
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return self._graphs[key]


def _copy_step(static, step) -> None:
    """Copy a new step's index tensors into the graph's static ones (same shapes: same bucket).
    Every static tensor must own its elements (no stride-0 views): `copy_` refuses those."""
    for f in fields(step):
        new = getattr(step, f.name)
        if isinstance(new, torch.Tensor):
            getattr(static, f.name).copy_(new)
        elif isinstance(new, tuple) and new and isinstance(new[0], torch.Tensor):
            for dst, src in zip(getattr(static, f.name), new):
                dst.copy_(src)
