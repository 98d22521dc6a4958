"""DeviceWorker: the Ray actor that owns one device and runs its Engine.

The engine's step loop runs on a thread of its own; the actor's asyncio side only moves
messages. `generate` is a streaming generator: each yielded OutputFrame carries every
token produced since the previous one (frames, never one actor call per token), so a
slow consumer gets fewer, larger frames instead of falling behind.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from dataclasses import asdict

from actors.engine import Engine, EngineConfig
from actors.handoff import HandoffState, relay_handoff
from actors.worker_metrics import WorkerMetrics
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
FRAME_INTERVAL_S = 0.02   # frames go to the consumers at most this often (see EngineLoop._pace)


class _Stream:
    """Frames of one request waiting for its consumer, merged while they wait."""

    def __init__(self) -> None:
        self.pending: OutputFrame | None = None
        self.event = asyncio.Event()
        self.finished = False   # the frame that ends the request went to the consumer

    def push(self, frame: OutputFrame) -> None:
        if self.pending is None:
            self.pending = frame
        else:
            p = self.pending
            p.token_ids += frame.token_ids
            p.token_times += frame.token_times
            p.text += frame.text
            p.finish_reason = frame.finish_reason
            p.error = frame.error
        self.event.set()

    def take(self) -> OutputFrame:
        frame, self.pending = self.pending, None
        self.event.clear()
        return frame

    async def frames(self, worker_id: str):
        """Frame dicts as they come, up to the one that finishes the request."""
        while not self.finished:
            await self.event.wait()
            frame = self.take()
            frame.worker_id = worker_id
            self.finished = frame.finished
            yield asdict(frame)


class EngineLoop:
    """Runs an Engine on a background thread; commands and frames cross via queues."""

    def __init__(self, engine: Engine, deliver):
        self.engine = engine
        self.deliver = deliver          # called on the engine thread with each list of frames
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopped = False
        self._pending: list[OutputFrame] = []   # frames not yet handed over (see _pace)
        self._last_delivery = 0.0
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((fn, args, future))
        self.wake.set()
        return future

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.wake.wait(IDLE_WAIT_S)
                self.wake.clear()
                continue
            try:
                frames = self.engine.step()
            except Exception as exc:   # never let one bad step kill the worker
                logger.exception("engine step failed")
                frames = self.engine.fail_all(f"engine step failed: {exc}")
            self._pace(frames)
        self._flush()

    def _pace(self, frames: list[OutputFrame]) -> None:
        """Hand frames to the actor's event loop at most every FRAME_INTERVAL_S, except a
        request's first and last frame, which go at once (TTFT, completion). Each hand-over
        wakes the event loop and the Ray stream of every request in it, and those threads then
        trade the GIL with this one at every torch op of the next forward: on a tiny model
        (~1 ms steps, 12 models, 4 req/s) a hand-over per step made the forward 2.6 ms instead
        of 1.2 ms, one per 10 ms 1.4 ms, one per 25 ms 1.1 ms. A model whose step is longer
        than the interval is unaffected (every step goes out), and the client-observed times
        the load tests score include the wait (like vLLM's --stream-interval)."""
        requests = self.engine.requests
        urgent = any(frame.finished or (frame.request_id in requests and len(frame.token_ids)
                                        == requests[frame.request_id].num_output_tokens) for frame in frames)
        self._pending.extend(frames)
        now = time.perf_counter()
        if urgent or now - self._last_delivery >= FRAME_INTERVAL_S or not self.engine.has_unfinished():
            self._flush(now)

    def _flush(self, now: float | None = None) -> None:
        if self._pending:
            frames, self._pending = self._pending, []
            self.deliver(frames)
            self._last_delivery = time.perf_counter() if now is None else now

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, args, future = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._flush()   # a command (detach, abort, stats) sees every frame made so far delivered
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)


class DeviceWorker:
    """One per device. Methods are async; the engine never blocks the actor's event loop."""

    def __init__(self, worker_id: str, config: dict | None = None, num_threads: int | None = None,
                 node_id: str | None = None, shared_kv: bool = False):
        """shared_kv: on a CPU device, keep the KV pool in a node-shared region (/dev/shm), so a
        same-node KV handoff exports without a copy."""
        import torch

        from actors.handoff import KVHandoff

        if num_threads:
            torch.set_num_threads(num_threads)   # each virtual device gets its share of cores
        self.worker_id = worker_id
        self.node_id = node_id or _current_node_id()
        self.role = "mixed"
        engine_config = EngineConfig(**(config or {}))
        device_kind = "cuda" if torch.device(engine_config.device).type == "cuda" else "cpu"
        self.handoff = KVHandoff(worker_id, self.node_id, device_kind)
        kv_buffer = None
        if shared_kv and device_kind == "cpu":
            kv_buffer = self.handoff.shared_kv_region(engine_config.kv_bytes)
        self.engine = Engine(engine_config, kv_buffer=kv_buffer)
        self._router = None
        self._peer_nodes: dict[str, str] = {}
        self.streams: dict[str, _Stream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_loop = EngineLoop(self.engine, self._deliver_threadsafe)
        self.metrics = WorkerMetrics(worker_id, self.engine, self.engine_loop, num_threads)   # off the hot path
        self.started = time.time()

    async def ready(self) -> str:
        self.loop = asyncio.get_running_loop()
        return self.worker_id

    async def register_model(self, name: str, path: str) -> dict:
        return await asyncio.wrap_future(self.engine_loop.call(self.engine.register_model, name, path))

    async def unregister_model(self, name: str) -> None:
        await asyncio.wrap_future(self.engine_loop.call(self.engine.unregister_model, name))

    async def set_role(self, role: str) -> None:
        if role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"role must be mixed, prefill or decode; got {role!r}")
        self.role = role

    async def generate(self, req: dict):
        """Stream OutputFrame dicts for one request; the last one has finish_reason set."""
        self.loop = self.loop or asyncio.get_running_loop()
        request = GenerateRequest.from_dict(req)
        stream = _Stream()
        self.streams[request.request_id] = stream
        try:
            try:
                await asyncio.wrap_future(self.engine_loop.call(self.engine.add_request, request))
            except ValueError as exc:
                stream.finished = True
                yield asdict(OutputFrame(request.request_id, finish_reason=FINISH_ERROR, error=str(exc),
                                         worker_id=self.worker_id))
                return
            handoff_tried = False
            async for frame in stream.frames(self.worker_id):
                yield frame
                if self.role == "prefill" and not handoff_tried and not stream.finished:
                    handoff_tried = True   # decode elsewhere (actors/handoff.py); relayed frames end it
                    async for relayed in relay_handoff(self, request, stream):
                        yield relayed
        finally:
            self.streams.pop(request.request_id, None)
            if not stream.finished:   # the consumer went away: free the request's KV
                self.engine_loop.call(self.engine.abort, request.request_id)

    async def generate_prefilled(self, state: dict, desc=None):
        """The decode side of a KV handoff: adopt the request (KV through `desc`, a KVDescriptor),
        answer one ack {"adopted": bool, "error": str | None}, then stream its OutputFrame dicts."""
        self.loop = self.loop or asyncio.get_running_loop()
        handoff_state = HandoffState(**state)
        request_id = handoff_state.request["request_id"]
        stream = _Stream()
        self.streams[request_id] = stream
        try:
            try:
                adopted = await asyncio.wrap_future(
                    self.engine_loop.call(self.handoff.adopt, self.engine, handoff_state, desc))
            except ValueError as exc:   # unknown model, bad state: the sender keeps the request
                stream.finished = True
                yield {"adopted": False, "error": str(exc)}
                return
            del desc   # drop an object-store ref as soon as the KV is in
            yield {"adopted": adopted, "error": None}
            async for frame in stream.frames(self.worker_id):
                yield frame
        finally:
            self.streams.pop(request_id, None)
            if not stream.finished:
                self.engine_loop.call(self.engine.abort, request_id)

    async def close(self) -> None:
        """Before the actor is killed: stop stepping and unlink the shared KV files (a kill skips __del__)."""
        self.metrics.stop()
        self.engine_loop.stop()
        self.handoff.close()

    async def node(self) -> str:
        return self.node_id

    def get_router(self):
        if self._router is None:
            import ray

            from scheduler.messages import ROUTER_NAME

            self._router = ray.get_actor(ROUTER_NAME)
        return self._router

    async def set_router(self, router) -> None:
        self._router = router

    async def peer_node(self, worker_id: str, handle) -> str:
        if worker_id not in self._peer_nodes:
            self._peer_nodes[worker_id] = await handle.node.remote()
        return self._peer_nodes[worker_id]

    async def abort(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.engine_loop.call(self.engine.abort, request_id))

    async def stats(self) -> dict:
        stats = await asyncio.wrap_future(self.engine_loop.call(self.engine.stats))
        stats.update(worker_id=self.worker_id, node_id=self.node_id, role=self.role,
                     device=self.engine.config.device, pid=os.getpid(),
                     handoff={"handed_off": self.handoff.num_handed_off, "adopted": self.handoff.num_adopted,
                              "recomputed": self.handoff.num_recomputed})
        return stats

    async def telemetry(self) -> dict:
        return self.metrics.summary()   # totals and gauges for `tokenmux status --watch`

    async def timeline(self) -> list[tuple]:
        return await asyncio.wrap_future(self.engine_loop.call(lambda: list(self.engine.timeline)))

    def _deliver_threadsafe(self, frames: list[OutputFrame]) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver, frames)

    def _deliver(self, frames: list[OutputFrame]) -> None:
        for frame in frames:
            stream = self.streams.get(frame.request_id)
            if stream is not None:
                stream.push(frame)


def _current_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None
