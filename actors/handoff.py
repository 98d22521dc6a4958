"""Prefill/decode disaggregation: a prefill worker hands a request's KV to a decode worker.

The caller opens one stream, on the worker the router picked (`worker.generate`), and reads
it with `stream_frames`; the router is asked once per request, never per token:

    caller <-first frames-- prefill worker.generate
      |                      |  prefill, first frame; router.pick_decode (once)
      |                      +-- detach + export KV --> decode worker.adopt_prefilled(state, descriptor)
      |                      |                      <-- HandoffAck    (KV imported into its pool)
      |                      +-- last frame: moved_to = the decode worker
      +--- opens decode worker.generate_prefilled(request_id) <-decode frames, straight to the caller

Two halves. `KVHandoff` runs on a worker's engine thread, between steps, and reaches the
engine only through its verbs (detach, end_detach, adopt) and the KV only through
KVTransfers (actors/kv_transfer.py). `HandoffRelay` is the async protocol a prefill worker
owns; it needs the engine-thread call, the router and the request's FrameBuffer, nothing
else of the worker. The KV descriptor rides on the decode dispatch (`adopt_prefilled(state,
desc)`), which answers the ack: one plain round trip moves the KV (a streaming call's first
item measured ~0.5-1 ms slower here, and a stream opened alongside the dispatch ~0.5 ms),
and the prefill worker frees its blocks as soon as the ack says the receiver has them. Its
stream then ends with a frame whose `moved_to` names the decode worker; the caller's
`stream_frames` opens `generate_prefilled(request_id)` there the moment it reads that frame
(actors/frame_stream.py), and the adopted request's frames wait in the decode worker's buffer
until it does (a decode worker aborts an adopted request whose stream never comes, e.g.
because the caller left at that moment). No frame passes through the prefill worker after
the handoff, and the ingress and the router never learn a handoff happened.

A request a prefill worker will hand off is held from the step that makes its first token
(`Engine.add_request(hold_after_prefill=True)`): it never decodes there while the router is
asked and the KV moves, so a fast engine cannot finish it locally first; without a decode
worker it is let go on where it was (`KVHandoff.keep`).

Nothing is lost on failure. No decode worker, a failed export or a decode worker that
fails before its ack: the held request continues on the prefill worker, KV untouched.
A failed import (KVTransferError, no room): the decode worker recomputes the prefix.
A decode worker that dies mid-stream is a worker lost mid-stream like any other: the
caller's one resume path (deploy/serve_app/cluster_engine.py) continues the request on
another worker from the output it already has. Seeded sampling is never handed off (its
generator state lives with the request on the prefill worker); greedy and unseeded
sampling are.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, AsyncIterator, Callable

from actors.frame_stream import FrameBuffer
from actors.kv_transfer import KVDescriptor, KVTransfers
from actors.tp_handoff import GroupKVDescriptor, layout_mismatch
from scheduler.messages import DecodeTarget, GenerateRequest, HandoffCounts, HandoffState, OutputFrame

logger = logging.getLogger(__name__)

ACK_TIMEOUT_S = 60.0


class KVHandoff:
    """The engine-thread half: detach + export on the sender, adopt on the receiver.

    A tensor-parallel model led here moves as a GroupKVDescriptor (actors/tp_handoff.py): this
    rank's shard through this worker's transfers, each member's through its own."""

    def __init__(self, engine, transfers: KVTransfers):
        self.engine = engine
        self.transfers = transfers
        self.exports: dict[str, KVDescriptor | GroupKVDescriptor] = {}   # exported, waiting for the receiver's ack
        self.num_handed_off = 0
        self.num_adopted = 0
        self.num_recomputed = 0

    def counts(self) -> HandoffCounts:
        return HandoffCounts(self.num_handed_off, self.num_adopted, self.num_recomputed)

    # ---- sender ------------------------------------------------------------------------

    def detach_and_export(self, request_id: str,
                          dst_node_id: str) -> tuple[HandoffState, KVDescriptor | GroupKVDescriptor] | None:
        """Detach the request and export its KV; None when it cannot be (it then stays here)."""
        detached = self.engine.detach(request_id)
        if detached is None:
            return None
        state, blocks = detached
        model, n = state.request.model, state.num_computed_tokens
        desc = None
        try:
            desc = self.transfers.export(request_id, model, blocks, n, dst_node_id)
            members = self.engine.members_of(model)
            if members is not None:   # each member exports its shard of the same blocks
                desc = GroupKVDescriptor((desc, *members.export_shards(request_id, model, blocks.block_ids, n,
                                                                       dst_node_id)))
        except Exception as exc:   # KVTransferError, object store full, a member gone, ...: keep it here
            if isinstance(desc, KVDescriptor):
                self.transfers.release(desc)
            logger.warning("handoff of %s: export failed (%s); continuing locally", request_id, exc)
            self.engine.end_detach(request_id, handed_off=False)
            return None
        self.exports[request_id] = desc
        self.engine.metrics.handoff_started(request_id)
        return state, desc

    def keep(self, request_id: str) -> None:
        """No decode worker for a request held after its prefill: it decodes on here."""
        self.engine.end_detach(request_id, handed_off=False)

    def end_export(self, request_id: str, handed_off: bool) -> None:
        """The receiver has the KV (free it here) or will not get it (the request continues here).
        A second call for the same request is a no-op."""
        desc = self.exports.pop(request_id, None)
        if desc is None:
            return
        try:
            self._release(desc)
        finally:
            self.engine.metrics.handoff_finished(request_id, desc.model, desc.nbytes, handed_off)
            self.engine.end_detach(request_id, handed_off)
            self.num_handed_off += handed_off

    def _release(self, desc: KVDescriptor | GroupKVDescriptor) -> None:
        if isinstance(desc, GroupKVDescriptor):
            try:
                self.transfers.release(desc.shards[0])
            finally:
                self.engine.members_of(desc.model).release_shards(desc.shards[1:])
        else:
            self.transfers.release(desc)

    # ---- receiver ----------------------------------------------------------------------

    def adopt(self, state: HandoffState, desc: KVDescriptor | GroupKVDescriptor | None) -> bool:
        """Queue the request on this engine with its KV (True) or for recompute (False): a KV
        whose split does not match this engine's model (actors/tp_handoff.py) is refused, with
        its reason logged, and recomputed."""
        if desc is not None and (desc.model != state.request.model or desc.num_tokens != state.num_computed_tokens):
            raise ValueError(f"descriptor of {desc.request_id!r} does not match the request it came with")
        if desc is not None:
            refused = layout_mismatch(desc, *self.engine.kv_layout(desc.model))
            if refused is not None:
                logger.warning("KV handoff refused, recomputing the prefix: %s", refused)
                desc = None
        fill = None if desc is None else (lambda blocks: self._import(desc, blocks))
        adopted = self.engine.adopt(state, fill)
        if adopted:
            self.num_adopted += 1
        else:
            self.num_recomputed += 1
        return adopted

    def _import(self, desc: KVDescriptor | GroupKVDescriptor, blocks) -> None:
        if not isinstance(desc, GroupKVDescriptor):
            self.transfers.import_(desc, blocks)
            return
        self.transfers.import_(desc.shards[0], blocks)   # this rank's; the members theirs, into the same ids
        self.engine.members_of(desc.model).import_shards(desc.shards[1:], blocks.block_ids)


class HandoffRelay:
    """The async half, owned by a prefill worker: hand one request off to a decode worker.

    call(fn, *args) runs fn on the worker's engine thread and returns a concurrent Future;
    router() gives the GlobalRouter handle.
    """

    def __init__(self, worker_id: str, call: Callable[..., concurrent.futures.Future], router: Callable[[], Any],
                 kv: KVHandoff):
        self.worker_id = worker_id
        self.call = call
        self.router = router
        self.kv = kv

    async def _on_engine(self, fn, *args):
        return await asyncio.wrap_future(self.call(fn, *args))

    def decode_target(self, request: GenerateRequest) -> asyncio.Task | None:
        """Ask the router for the request's decode worker while its prefill runs (so the answer
        is there when the first frame is); None when the request is never handed off. A request
        with a task is added with hold_after_prefill: it waits, detached, for hand_off()."""
        params = request.sampling_params
        if not params.greedy and params.seed is not None:
            return None
        return asyncio.get_running_loop().create_task(self._decode_target(request))

    async def hand_off(self, request: GenerateRequest, buffer: FrameBuffer,
                       target_task: asyncio.Task) -> AsyncIterator[OutputFrame]:
        """Run by a prefill worker's generate() after the first frame, with decode_target's task.

        Yields the frames that end this worker's part: the tokens made before the detach, then a
        frame whose `moved_to` names the decode worker that has adopted the request (the reader
        follows it there, actors/frame_stream.py). Yields nothing (and returns) when no handoff
        happened: the caller's loop then goes on with the local frames.
        """
        target = await target_task
        if target is None:
            await self._on_engine(self.kv.keep, request.request_id)
            return
        exported = await self._on_engine(self.kv.detach_and_export, request.request_id, target.node_id)
        if exported is None:
            return
        state, desc = exported
        if buffer.pending is not None:   # tokens made between the first frame and the detach
            yield buffer.take()
        handed_off = False
        try:
            # The descriptor rides on the dispatch, whose answer is the ack: one plain round trip.
            ack_ref = target.handle.adopt_prefilled.remote(state, desc)
            del desc   # the dispatch holds it now (an object-store ref must not outlive the receiver's use)
            try:
                ack = await asyncio.wait_for(ack_ref, ACK_TIMEOUT_S)
                if ack.error:
                    raise ValueError(ack.error)
            except Exception as exc:   # decode worker dead, refused the model, too slow
                logger.warning("handoff of %s to %s failed before the KV moved (%s); decoding locally",
                               request.request_id, target.worker_id, exc)
                return
            handed_off = True
        finally:
            # Before any await: a caller that left while the ack came leaves the request here
            # (aborted by the worker's serving context); the receiver drops its unclaimed copy.
            self.call(self.kv.end_export, request.request_id, handed_off)
        yield buffer.sent(OutputFrame(request.request_id, worker_id=self.worker_id, moved_to=target))

    async def _decode_target(self, request: GenerateRequest) -> DecodeTarget | None:
        try:
            target = await self.router().pick_decode.remote(request.model, request.slo)
        except Exception as exc:   # no router, no decode worker: decode here
            logger.info("handoff of %s: no decode worker (%s); decoding locally", request.request_id, exc)
            return None
        return None if target.worker_id == self.worker_id else target

