"""Prefill/decode disaggregation: a prefill worker hands a request's KV to a decode worker.

The stream path. The caller keeps ONE stream, the one it opened on the worker the router
picked (`worker.generate`); the router is asked once per request, never per token:

    caller <-frames- prefill worker.generate <-frames- decode worker.generate_prefilled
                      |  prefill, first frame               ^  import KV into its pool,
                      |  router.pick_decode (once)          |  ack, then decode frames
                      +-- detach + export KV -- descriptor -+

After the prefill step's first frame, a worker in role "prefill" picks a decode worker
(`router.pick_decode`), takes the request out of its own scheduling (its KV blocks stay
held), exports them through the transport `choose_transport(src node, dst node, device)`
picks (shm on one CPU node, object store across nodes, CUDA IPC on one GPU node) and
calls `generate_prefilled(state, descriptor)` on the decode worker. That stream first
answers an ack (KV adopted, or queued for recompute), after which the prefill worker frees
the held blocks, then the decode frames, which the prefill worker relays to the caller
unchanged (frames carry the decode worker's id). One extra actor hop per frame, not per
token, and the caller, the ingress and the router never learn a handoff happened.

Nothing is lost on failure. No decode worker, a failed export or a decode worker that
fails before its ack: the held request continues on the prefill worker, KV untouched.
A failed import (KVTransferError, no room): the decode worker recomputes the prefix.
A decode worker that dies mid-stream: the prefill worker recomputes prompt + every token
relayed so far and decodes the rest itself. Seeded sampling is never handed off (its
generator state lives with the request on the prefill worker); greedy and unseeded
sampling are.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

from actors.kv_transfer import KVDescriptor, KVTransferError, KVTransport, choose_transport, make_transport
from scheduler.kv_blocks import blocks_for_tokens
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame

logger = logging.getLogger(__name__)

ACK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HandoffState:
    """What travels with the KV descriptor: the request and its output so far."""

    request: dict                 # GenerateRequest.to_dict()
    output_token_ids: list[int]
    token_times: list[float]
    num_computed_tokens: int      # tokens whose KV the descriptor carries
    num_sent_chars: int           # text already streamed to the caller


class KVHandoff:
    """One per worker process: its transports (made on first use) and the export/import steps.

    export/adopt run on the engine thread (between steps), so the pool does not change under them.
    """

    def __init__(self, worker_id: str, node_id: str, device_kind: str):
        self.worker_id = worker_id
        self.node_id = node_id
        self.device_kind = device_kind
        self.transports: dict[str, KVTransport] = {}
        self.exports: dict[str, tuple[KVTransport, KVDescriptor]] = {}
        self.num_handed_off = 0
        self.num_adopted = 0
        self.num_recomputed = 0

    def transport(self, name: str) -> KVTransport:
        if name not in self.transports:
            self.transports[name] = make_transport(name)
        return self.transports[name]

    def shared_kv_region(self, nbytes: int):
        """A node-shared uint8 buffer `[nbytes]` for the KV pool: shm handoffs then export without a copy."""
        return self.transport("shm").allocate_region(nbytes)

    # ---- sender (engine thread) --------------------------------------------------------

    def detach_and_export(self, engine, request_id: str, dst_node_id: str) -> tuple[HandoffState, KVDescriptor] | None:
        """Detach the request and export its KV; None when it cannot be (it then stays here)."""
        request = engine.detach(request_id)
        if request is None:
            return None
        try:
            name = choose_transport(self.node_id, dst_node_id, self.device_kind)
            m = engine.models[request.model]
            n = request.num_computed_tokens
            desc = KVDescriptor(request_id, request.model, m.spec.num_layers, m.spec.num_kv_heads, m.spec.head_dim,
                                str(m.dtype).removeprefix("torch."), tuple(request.block_ids[:blocks_for_tokens(n)]),
                                n, src_node_id=self.node_id, src_worker_id=self.worker_id)
            view, grid = engine.kv_views(request.model)
            transport = self.transport(name)
            if grid is not None:
                desc = transport.export(grid, desc, from_pool=True)
            else:
                from actors.kv_pool import block_index

                desc = transport.export(view[block_index(view, list(desc.block_ids))], desc)
        except Exception as exc:   # KVTransferError, object store full, ...: keep it here
            logger.warning("handoff of %s: export failed (%s); continuing locally", request_id, exc)
            engine.reattach(request_id)
            return None
        self.exports[request_id] = (transport, desc)
        engine.metrics.handoff_started(request_id)
        assembler = engine.held[request_id][1]
        state = HandoffState(GenerateRequest(request.request_id, request.model, tuple(request.prompt_token_ids),
                                             request.sampling_params, request.slo, request.arrival_time).to_dict(),
                             list(request.output_token_ids), list(request.token_times), n,
                             assembler.num_sent_chars)
        return state, desc

    def finish_export(self, engine, request_id: str, handed_off: bool) -> None:
        """Receiver done with the KV: free it (handed off) or let the request continue here."""
        transport, desc = self.exports.pop(request_id)
        try:
            transport.release(desc)
        finally:
            engine.metrics.handoff_finished(request_id, desc.model, desc.nbytes, handed_off)
            if handed_off:
                engine.release_held(request_id)
                self.num_handed_off += 1
            else:
                engine.reattach(request_id)

    # ---- receiver (engine thread) ------------------------------------------------------

    def adopt(self, engine, state: HandoffState, desc: KVDescriptor | None) -> bool:
        """Queue the request on this engine with its KV (True) or for recompute (False)."""
        req = GenerateRequest.from_dict(state.request)

        def fill(dst_block_ids: list[int]) -> None:
            transport = self.transport(desc.transport)
            view, grid = engine.kv_views(req.model)
            if grid is not None:
                transport.import_(desc, out=grid, dst_block_ids=dst_block_ids)
            else:
                from actors.kv_pool import block_index

                view[block_index(view, dst_block_ids)] = transport.import_(desc).to(view.device)

        if desc is not None and (desc.model != req.model or desc.num_tokens != state.num_computed_tokens):
            raise ValueError(f"descriptor of {desc.request_id!r} does not match the request it came with")
        adopted = engine.add_prefilled(req, state.output_token_ids, state.token_times, state.num_computed_tokens,
                                       fill if desc is not None else None, state.num_sent_chars)
        if adopted:
            self.num_adopted += 1
        else:
            self.num_recomputed += 1
        return adopted

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


async def relay_handoff(worker, request: GenerateRequest, stream):
    """Async generator run by a prefill worker's generate() after the first frame.

    Yields frame dicts for the caller until the request finishes. Yields nothing (and
    returns) when no handoff happened: the caller's loop then goes on with the local stream.
    """
    params = request.sampling_params
    if not params.greedy and params.seed is not None:
        return
    try:
        router = worker.get_router()
        dst_id, dst = await router.pick_decode.remote(request.model, asdict(request.slo))
        if dst_id == worker.worker_id:
            return
        dst_node = await worker.peer_node(dst_id, dst)
    except Exception as exc:   # no router, no decode worker: decode here
        logger.info("handoff of %s: no decode worker (%s); decoding locally", request.request_id, exc)
        return
    call = worker.engine_loop.call
    exported = await asyncio.wrap_future(call(worker.handoff.detach_and_export, worker.engine,
                                              request.request_id, dst_node))
    if exported is None:
        return
    state, desc = exported
    sent_tokens = list(state.output_token_ids)
    sent_chars = state.num_sent_chars
    if stream.pending is not None:   # tokens made between the first frame and the detach
        frame = stream.take()
        frame.worker_id = worker.worker_id
        yield asdict(frame)
    started = time.perf_counter()
    gen = dst.generate_prefilled.remote(asdict(state), desc)
    acked = False
    try:
        try:
            ack = await asyncio.wait_for(gen.__anext__(), ACK_TIMEOUT_S)
            ack = await ack
            if ack.get("error"):
                raise ValueError(ack["error"])
        except Exception as exc:   # decode worker dead, refused the model, too slow
            logger.warning("handoff of %s to %s failed before the KV moved (%s); decoding locally",
                           request.request_id, dst_id, exc)
            await asyncio.wrap_future(call(worker.handoff.finish_export, worker.engine, request.request_id, False))
            acked = True   # nothing of ours is left held
            return
        acked = True
        await asyncio.wrap_future(call(worker.handoff.finish_export, worker.engine, request.request_id, True))
        logger.debug("handoff of %s to %s in %.1f ms (%s, adopted=%s)", request.request_id, dst_id,
                     1e3 * (time.perf_counter() - started), desc.transport, ack.get("adopted"))
        try:
            async for ref in gen:
                frame = await ref
                sent_tokens += frame["token_ids"]
                sent_chars += len(frame["text"])
                stream.finished = frame["finish_reason"] is not None
                yield frame
                if stream.finished:
                    return
        except Exception as exc:
            logger.warning("decode worker %s failed mid-stream for %s (%s); recomputing here",
                           dst_id, request.request_id, exc)
        # The decode stream broke: recompute what was relayed and decode the rest here.
        retry = HandoffState(state.request, sent_tokens, [], 0, sent_chars)
        try:
            await asyncio.wrap_future(call(worker.handoff.adopt, worker.engine, retry, None))
        except ValueError as exc:
            stream.finished = True
            yield asdict(OutputFrame(request.request_id, finish_reason=FINISH_ERROR, error=str(exc),
                                     worker_id=worker.worker_id))
            return
        async for frame in stream.frames(worker.worker_id):
            yield frame
    finally:
        if not stream.finished:
            try:
                import ray

                ray.cancel(gen)   # the caller left: the decode worker aborts its copy
            except Exception:
                pass
        if not acked:   # the caller left before the ack: free what we hold
            worker.engine_loop.call(_finish_quietly, worker, request.request_id)


def _finish_quietly(worker, request_id: str) -> None:
    if request_id in worker.handoff.exports:
        worker.handoff.finish_export(worker.engine, request_id, False)
    worker.engine.abort(request_id)
