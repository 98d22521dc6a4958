"""DeviceWorker: the Ray actor that owns one device and runs its Engine.

The engine's step loop runs on a thread of its own; the actor's asyncio side only moves
messages. `generate(GenerateRequest)` is a streaming generator: each yielded OutputFrame
carries every token produced since the previous one (frames, never one actor call per
token, actors/frame_stream.py), so a slow consumer gets fewer, larger frames instead of
falling behind. `stats()` answers a WorkerStats (scheduler/messages.py), the router's one
source of truth about this device; `health()` is its watchdog, answered off the engine
thread (the engine loop stopped, or one step ran past `step_bound_s`), which the topology's
supervisor reads to replace it (cluster/supervisor.py). In the "prefill" role the worker's HandoffRelay hands
each request's KV to a decode worker after its first frame and ends its stream with a frame
that names that worker (actors/handoff.py); `generate_prefilled` is the receiving end, which
the caller reads from then on.

Tensor parallelism (actors/tensor_parallel.py): after `join_tp_group`, `register_tp_model` holds
this device's part of a model split over the group. The leader (rank 0) serves its requests
and sends each step to the members' `follow`, which runs on the member's engine thread
between its own steps: a member goes on serving its own models, and the group's steps
interleave with theirs token by token.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time

from actors.engine import Engine, EngineConfig
from actors.frame_stream import FrameBuffer, error_frame
from actors.handoff import HandoffRelay, KVHandoff
from actors.heap import freeze_heap
from actors.kv_transfer import KVDescriptor, KVTransfers
from actors.tensor_parallel import TPShard
from actors.tp_group import TPGroup, TPStep, free_address
from actors.tp_handoff import GroupKVDescriptor
from actors.tp_member import TPMembers
from actors.worker_metrics import WorkerMetrics
from actors.worker_reports import StepRecord, WorkerHealth, WorkerTelemetry
from scheduler.messages import (ROLES, ROUTER_NAME, GenerateRequest, HandoffAck, HandoffState,
                                OutputFrame, RegisteredModel, WorkerStats)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
ATTACH_TIMEOUT_S = 30.0   # an adopted request whose sender never opens its stream is aborted after this
FRAME_INTERVAL_S = 0.02   # frames go to the consumers at most this often (see EngineLoop._pace)
STEP_BOUND_S = 60.0       # the watchdog: a step running longer than this makes the worker unhealthy


class EngineLoop:
    """Runs an Engine on a background thread; commands and frames cross via queues.

    nice > 0 lowers the engine thread's CPU priority (and its torch threads', made from it).
    A virtual device computes on the host's cores, which the HTTP edge, the router and the
    workers' own Ray threads share; a GPU would not take them. On a 2-core host at 10x
    overload, engines at the edge's priority left it ~3 s behind its arrivals, so accepted
    requests waited that long before admission saw them (issue 12); yielding, they waited
    ~0.1 s. Linux gives each thread its own nice value; elsewhere the setting is skipped."""

    def __init__(self, engine: Engine, deliver, nice: int = 0):
        self.engine = engine
        self.nice = nice
        self.deliver = deliver          # called on the engine thread with each list of frames
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopped = False
        self._pending: list[OutputFrame] = []   # frames not yet handed over (see _pace)
        self._last_delivery = 0.0
        self.step_started: float | None = None   # monotonic start of the step running now (the watchdog's)
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.thread.is_alive():   # nobody would ever run it: fail now, not at the caller's deadline
            future.set_exception(RuntimeError("the engine loop has stopped"))
            return future
        self.inbox.put((fn, args, future))
        self.wake.set()
        return future

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)

    def problem(self, step_bound_s: float) -> str | None:
        """Why this loop serves nobody (the watchdog's verdict), or None while it steps."""
        if not self.thread.is_alive():
            return "the engine loop has stopped"
        started = self.step_started
        if started is not None and time.monotonic() - started > step_bound_s:
            return f"one engine step has run for {time.monotonic() - started:.0f} s (bound {step_bound_s:g} s)"
        return None

    def _run(self) -> None:
        if self.nice:
            _lower_priority(self.nice)
        while not self.stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.wake.wait(IDLE_WAIT_S)
                self.wake.clear()
                continue
            self.step_started = time.monotonic()
            try:
                frames = self.engine.step()
            except Exception as exc:   # never let one bad step kill the worker
                logger.exception("engine step failed")
                frames = self.engine.fail_all(f"engine step failed: {exc}")
            self.step_started = None
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
            # From here the caller can no longer cancel the call. If it already did (a client that
            # disconnected cancels the await), the call still runs, so that what the caller's
            # cleanup assumes may have happened (a request added, then aborted) did, but nobody
            # gets its result: setting one on a cancelled future raises, and that once killed
            # this thread and wedged the worker for good (issue 12).
            wanted = future.set_running_or_notify_cancel()
            self._flush()   # a command (detach, abort, stats) sees every frame made so far delivered
            try:
                result = fn(*args)
            except Exception as exc:
                if wanted:
                    future.set_exception(exc)
                else:
                    logger.warning("%s failed after its caller left: %s", getattr(fn, "__name__", fn), exc)
            else:
                if wanted:
                    future.set_result(result)


def _lower_priority(nice: int) -> None:
    """This thread's nice value raised by `nice` (Linux: per thread); logged where unsupported."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError) as exc:
        logger.warning("the engine thread keeps its CPU priority (%s)", exc)


class DeviceWorker:
    """One per device. Methods are async; the engine never blocks the actor's event loop."""

    def __init__(self, worker_id: str, config: EngineConfig | None = None, num_threads: int | None = None,
                 node_id: str | None = None, shared_kv: bool = False, step_bound_s: float = STEP_BOUND_S,
                 engine_nice: int = 0):
        """config: the engine's (None: EngineConfig()). shared_kv: on a CPU device, keep the KV pool in a
        node-shared region (/dev/shm), so a same-node KV handoff exports without a copy.
        step_bound_s: the watchdog's bound on one engine step (see `health`). engine_nice: how much
        lower the engine thread's CPU priority is than the worker's (see EngineLoop)."""
        if not step_bound_s > 0:
            raise ValueError(f"step_bound_s must be > 0, got {step_bound_s!r}")
        engine_config = EngineConfig() if config is None else config
        if not isinstance(engine_config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)   # each virtual device gets its share of cores
        self.worker_id = worker_id
        self.step_bound_s = step_bound_s
        self.node_id = node_id or _current_node_id() or ""
        self.role = "mixed"
        device_kind = "cuda" if torch.device(engine_config.device).type == "cuda" else "cpu"
        self.transfers = KVTransfers(worker_id, self.node_id, device_kind)
        kv_buffer = None
        if shared_kv and device_kind == "cpu":
            kv_buffer = self.transfers.shared_kv_region(engine_config.kv_bytes)
        self.engine = Engine(engine_config, kv_buffer=kv_buffer)
        self._router = None
        self.buffers: dict[str, FrameBuffer] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_loop = EngineLoop(self.engine, self._deliver_threadsafe, engine_nice)
        self.handoff = KVHandoff(self.engine, self.transfers)
        self.relay = HandoffRelay(worker_id, self.engine_loop.call, self.get_router, self.handoff)
        self.metrics = WorkerMetrics(worker_id, self.engine, self.engine_loop, num_threads)   # off the hot path
        self.tp_group: TPGroup | None = None
        self.tp_workers: tuple[str, ...] = ()   # the group's workers in rank order, as placement named them
        self.started = time.time()
        freeze_heap()   # torch, Ray, the KV pool: no collector pass walks them while streams wait (actors/heap.py)

    async def ready(self) -> str:
        self.loop = asyncio.get_running_loop()
        return self.worker_id

    async def register_model(self, name: str, path: str) -> RegisteredModel:
        registered = await self._on_engine(self.engine.register_model, name, path)
        freeze_heap(collect=False)   # the model's long-lived state joins the frozen heap
        return registered

    async def join_tp_group(self, shard: TPShard, address: str, workers: tuple[str, ...] = ()) -> None:
        """Make this device rank `shard.rank` of the tensor-parallel group at `address`; returns
        once every rank has joined (they join at once). workers: the group's worker ids in rank
        order (what `tp_group_workers` answers)."""
        if self.tp_group is not None:
            raise ValueError(f"worker {self.worker_id} already belongs to a tensor-parallel group")
        self.tp_group = await self._on_engine(TPGroup, shard, address, self.engine.device)
        self.tp_workers = tuple(workers)

    async def tp_group_workers(self) -> tuple[str, ...]:
        """The worker ids of this worker's tensor-parallel group in rank order; () in none."""
        return self.tp_workers if self.tp_group is not None else ()

    async def leave_tp_group(self) -> None:
        """Leave this worker's tensor-parallel group (one of its workers is gone; placement forms
        a new one): the requests of the models it leads wait here for the new group
        (Engine.strand), and its parts of the group's models are unregistered."""
        def leave() -> None:
            for name in self.engine.tp_models():
                self.engine.strand(name)
                self.engine.unregister_model(name)
            self.tp_group.close()

        if self.tp_group is not None:
            await self._on_engine(leave)
        self.tp_group, self.tp_workers = None, ()

    async def tp_address(self) -> str:
        """A loopback address free now on this worker's node: the rendezvous of a group it leads."""
        return free_address()

    async def register_tp_model(self, name: str, path: str, members: list | None = None,
                                kv_share: float = 0.5) -> RegisteredModel:
        """Hold this rank's part of `name`, split over this worker's group. members: on the
        leader, the other ranks' workers in rank order (each registered it first); None on a
        member. kv_share: of this device's KV pool, held for the group (Engine.register_model)."""
        if self.tp_group is None:
            raise ValueError(f"worker {self.worker_id} has joined no tensor-parallel group")
        leading = TPMembers(members) if members else None
        registered = await self._on_engine(self.engine.register_model, name, path, self.tp_group, leading, kv_share)
        freeze_heap(collect=False)
        return registered

    async def follow(self, step: TPStep) -> None:
        """Run the group leader's step on this rank's part (between this engine's own steps)."""
        await self._on_engine(self.engine.follow, step)

    async def export_kv_shard(self, request_id: str, model: str, block_ids: tuple[int, ...], num_tokens: int,
                              dst_node_id: str) -> KVDescriptor:
        """A member's part of its leader's KV handoff (actors/tp_handoff.py): export this rank's
        shard of the leader's blocks `block_ids`; they stay unchanged until `release_kv_shard`
        (the leader holds the ids until then)."""
        def export() -> KVDescriptor:
            return self.transfers.export(request_id, model, self.engine.kv_blocks(model, block_ids), num_tokens,
                                         dst_node_id)
        return await self._on_engine(export)

    async def import_kv_shard(self, desc: KVDescriptor, block_ids: tuple[int, ...]) -> None:
        """A member's part of its leader's adopt: copy this rank's shard into the leader's new blocks."""
        await self._on_engine(lambda: self.transfers.import_(desc, self.engine.kv_blocks(desc.model, block_ids)))

    async def release_kv_shard(self, desc: KVDescriptor) -> None:
        """The receiving group has this rank's shard (or gave up): free what its export kept alive."""
        await self._on_engine(self.transfers.release, desc)

    async def unregister_model(self, name: str, evict_host: bool = False) -> None:
        """Free the model's slot, KV view and host-cache mapping here (`evict_host`: the node's
        cache file too, for a model leaving the catalog); refused while it has requests here."""
        await self._on_engine(self.engine.unregister_model, name, evict_host)

    async def cut_model(self, name: str, reason: str) -> int:
        """End every request of `name` here with an explicit error frame naming `reason` (a removed
        model whose drain ran out); returns how many were cut."""
        def cut() -> list[str]:
            ids = self.engine.requests_of(name)
            for request_id in ids:
                self.engine.abort(request_id)
            return ids

        ids = await self._on_engine(cut)
        for request_id in ids:
            buffer = self.buffers.get(request_id)
            if buffer is not None:
                buffer.push(error_frame(request_id, self.worker_id, ValueError(reason)))
        return len(ids)

    async def set_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        self.role = role

    async def generate(self, request: GenerateRequest):
        """Stream the request's OutputFrames; the last one has finish_reason set."""
        async with self._serving(request.request_id) as buffer:
            target = self.relay.decode_target(request) if self.role == "prefill" else None
            try:
                try:   # a request to hand off is held after its prefill: it never decodes here meanwhile
                    await self._on_engine(self.engine.add_request, request, target is not None)
                except ValueError as exc:
                    yield buffer.sent(error_frame(request.request_id, self.worker_id, exc))
                    return
                async for frame in buffer.frames():
                    yield frame
                    if target is not None and not buffer.finished:   # decode elsewhere (actors/handoff.py)
                        async with contextlib.aclosing(self.relay.hand_off(request, buffer, target)) as handed:
                            async for frame in handed:
                                yield frame
                                if frame.moved_to is not None:   # the reader goes on at the decode worker
                                    return
                        target = None
            finally:
                if target is not None:
                    target.cancel()   # it ended before its first frame was out: no handoff

    async def adopt_prefilled(self, state: HandoffState,
                              desc: KVDescriptor | GroupKVDescriptor | None = None) -> HandoffAck:
        """The decode side of a KV handoff: adopt the request with its KV (the descriptor rides on
        this call) and answer at once; its frames go to `generate_prefilled`, which the sender
        opens when this answers."""
        request_id = state.request.request_id
        buffer = self._buffer(request_id)
        if not buffer.attached:   # a sender that died before opening the stream leaves no orphan behind
            self.loop.call_later(ATTACH_TIMEOUT_S, self._drop_unattached, request_id, buffer)
        try:
            adopted = await self._on_engine(self.handoff.adopt, state, desc)
        except ValueError as exc:   # unknown model, bad state: the sender keeps the request
            buffer.push(error_frame(request_id, self.worker_id, exc))
            return HandoffAck(False, str(exc))
        return HandoffAck(adopted)

    async def generate_prefilled(self, request_id: str):
        """The OutputFrames of a request adopted by `adopt_prefilled`."""
        async with self._serving(request_id) as buffer:
            async for frame in buffer.frames():
                yield frame

    async def close(self) -> None:
        """Before the actor is killed: stop stepping and unlink the shared KV files (a kill skips __del__)
        and the host weight-cache files this worker filled."""
        self.metrics.stop()
        self.engine_loop.stop()
        self.transfers.close()
        self.engine.slots.host.remove_created()

    async def node(self) -> str:
        return self.node_id

    def get_router(self):
        if self._router is None:
            import ray

            self._router = ray.get_actor(ROUTER_NAME)
        return self._router

    async def set_router(self, router) -> None:
        self._router = router

    async def stats(self) -> WorkerStats:
        engine = await self._on_engine(self.engine.stats)
        return WorkerStats(self.worker_id, self.node_id, engine, role=self.role, device=self.engine.config.device,
                           pid=os.getpid(), handoff=self.handoff.counts())

    async def health(self) -> WorkerHealth:
        """The watchdog, answered off the engine thread (a wedged step cannot hold it up): unhealthy
        when the engine loop has stopped or one step has run past `step_bound_s`."""
        problem = self.engine_loop.problem(self.step_bound_s)
        return WorkerHealth(self.worker_id, problem is None, problem or "", os.getpid())

    async def telemetry(self) -> WorkerTelemetry:
        return self.metrics.summary()   # totals and gauges for `tokenmux status --watch`

    async def timeline(self) -> list[StepRecord]:
        return await self._on_engine(lambda: list(self.engine.timeline))

    @contextlib.asynccontextmanager
    async def _serving(self, request_id: str):
        """The FrameBuffer of one request while its consumer reads it; the one place that
        aborts the request (freeing its KV) when the consumer goes away before the last frame."""
        buffer = self._buffer(request_id)
        buffer.attached = True
        try:
            yield buffer
        finally:
            self._forget_buffer(request_id, buffer)

    def _buffer(self, request_id: str) -> FrameBuffer:
        """The request's FrameBuffer, made on first use (by its stream or by adopt_prefilled)."""
        self.loop = self.loop or asyncio.get_running_loop()
        if request_id not in self.buffers:
            self.buffers[request_id] = FrameBuffer(self.worker_id)
        return self.buffers[request_id]

    def _forget_buffer(self, request_id: str, buffer: FrameBuffer) -> None:
        if self.buffers.get(request_id) is buffer:
            del self.buffers[request_id]
        if not buffer.finished:
            self.engine_loop.call(self.engine.abort, request_id)

    def _drop_unattached(self, request_id: str, buffer: FrameBuffer) -> None:
        if not buffer.attached:
            logger.warning("request %s was adopted but no stream came for it in %.0fs; aborting it",
                           request_id, ATTACH_TIMEOUT_S)
            self._forget_buffer(request_id, buffer)

    async def _on_engine(self, fn, *args):
        return await asyncio.wrap_future(self.engine_loop.call(fn, *args))

    def _deliver_threadsafe(self, frames: list[OutputFrame]) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver, frames)

    def _deliver(self, frames: list[OutputFrame]) -> None:
        for frame in frames:
            buffer = self.buffers.get(frame.request_id)
            if buffer is not None:
                buffer.push(frame)


def _current_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None
