"""Frames of one request between two actors: the worker buffers them, the caller iterates them.

    worker side   FrameBuffer           the engine thread pushes each step's frame; the request's
                                        consumer takes them, merged while they wait (a slow
                                        consumer gets fewer, larger frames, never falls behind)
    caller side   stream_frames(gen)    a worker's Ray streaming generator read as OutputFrames,
                                        cancelled on exit unless it ended

A handed-off request (actors/handoff.py) ends its prefill worker's stream with a frame whose
`moved_to` names the decode worker; `stream_frames` opens that worker's `generate_prefilled`
at once (no await between reading the frame and opening the stream) and reads on there, so
the decode frames come straight from the decode worker, and the reader sees one stream.
`FrameStream.worker_id` is the worker it reads from now (the one to blame if it dies).

Cancellation has one owner on each side. The caller: `stream_frames` cancels an unfinished
stream when its `async with` block is left (Ray then cancels the worker's generator). The
worker: its `serving` context (actors/worker.py) aborts the request in the engine, freeing its
KV, when the consumer went away before the last frame.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from scheduler.messages import FINISH_ERROR, OutputFrame

logger = logging.getLogger(__name__)


def error_frame(request_id: str, worker_id: str, error: Exception | str) -> OutputFrame:
    """The last frame of a request that failed: its error, by the worker that saw it."""
    return OutputFrame(request_id, finish_reason=FINISH_ERROR, error=str(error), worker_id=worker_id)


class FrameBuffer:
    """Frames of one request waiting for its consumer (lives on the worker's event loop)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.pending: OutputFrame | None = None
        self.event = asyncio.Event()
        self.finished = False   # the frame that ends the request went to the consumer
        self.attached = False   # a consumer reads it (a worker's serving context)

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
        """The merged pending frame, marked as this worker's; the caller sends it on."""
        frame, self.pending = self.pending, None
        self.event.clear()
        if frame.worker_id is None:
            frame.worker_id = self.worker_id
        return self.sent(frame)

    def sent(self, frame: OutputFrame) -> OutputFrame:
        """Record that `frame` goes to the consumer (also a frame relayed from another worker)."""
        self.finished = self.finished or frame.finished or frame.moved_to is not None   # moved: its part ends
        return frame

    async def frames(self):
        """Frames as they come, up to the one that finishes the request."""
        while not self.finished:
            await self.event.wait()
            yield self.take()


class FrameStream:
    """A worker's Ray streaming generator, read as OutputFrames; cancelled on exit unless it ended.

        async with stream_frames(handle.generate.remote(request)) as stream:
            async for frame in stream:
                ...
    """

    def __init__(self, gen: Any, worker_id: str | None = None) -> None:
        self._gen = gen
        self.worker_id = worker_id   # the worker read from now (a handoff moves it)
        self.ended = False    # a finishing frame came, or the generator is exhausted

    async def __aenter__(self) -> "FrameStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        if not self.ended:
            self.cancel()

    def __aiter__(self) -> "FrameStream":
        return self

    async def __anext__(self) -> OutputFrame:
        while not self.ended:
            try:
                ref = await self._gen.__anext__()
            except StopAsyncIteration:
                self.ended = True
                raise
            frame = await ref
            if frame.moved_to is not None:   # read on at the decode worker, opened before any await
                target, frame.moved_to = frame.moved_to, None
                self._gen = target.handle.generate_prefilled.remote(frame.request_id)
                self.worker_id = target.worker_id
                if not frame.token_ids and not frame.text:
                    continue
            if frame.finished:
                self.ended = True
            return frame
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop the worker's generator (non-blocking); it gets CancelledError and cleans up."""
        import ray

        self.ended = True
        try:
            ray.cancel(self._gen)
        except Exception as exc:   # already finished or its worker is gone: nothing left to stop
            logger.debug("cancelling a frame stream: %s", exc)


def stream_frames(gen: Any, worker_id: str | None = None) -> FrameStream:
    """The one way tokenmux reads a worker's frames (`worker.generate` / `generate_prefilled`);
    `worker_id`: the worker `gen` streams from."""
    return FrameStream(gen, worker_id)
