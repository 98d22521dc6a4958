"""ClusterEngineClient: the real `EngineClient` of the ingress (router + DeviceWorkers).

One request: `router.pick(model, slo)` -> `(worker_id, handle)`, then stream
`handle.generate(req)` (a Ray streaming generator of OutputFrames, several tokens per
frame, read through actors/frame_stream.py's `stream_frames`), then `router.release` when
it ends, however it ends. The router sits on one
call per request; the tokens flow worker -> ingress directly. Workers send token ids; the
text is made here (actors/output_stream.py's TextAssembler, one per request, kept across a
resume), stop strings included: a stop string ends the stream here, the tokens after it are
dropped and the worker's stream cancelled (it aborts the request).

Failures: a worker that dies is reported to the router (`report_failure`, which drops it
from routing) and the request goes on on another worker. Before its first token it is
simply sent again; after, it is *resumed*: the new worker adopts it with the output the
client already has (a HandoffState without KV: prompt + output recomputed in one prefill,
the text already sent not sent again, max_tokens and stop strings counted over the whole
output, a seeded generator advanced past the tokens drawn), so the client's stream goes on
as if nothing happened; greedy output equals an undisturbed run's. A request that cannot
go on (no worker left, `max_dispatches` deaths) ends with an error frame, never a silent cut.
A router that dies is asked for again (`router_source`) until it answers or
`router_recovery_s` passes: the supervisor restarts it and rebuilds its table.
One abort path: a consumer that leaves the stream early (closes or cancels `generate`)
cancels the worker's frame stream, and the worker aborts the request and frees its KV blocks
when its consumer goes away. A request handed from a prefill to a decode worker
(actors/handoff.py) is read from the decode worker directly from then on (`stream_frames`
follows the handoff); the worker it is read from is the one blamed if the stream breaks.

Never `ray.get` here: everything is awaited on the ingress's event loop.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.frame_stream import FrameStream, stream_frames
from actors.output_stream import TextAssembler
from deploy.openai_api.engine_protocol import ServedModel, TokenizerCache
from scheduler.messages import FINISH_ERROR, GenerateRequest, HandoffState, OutputFrame, RouterStatus
from scheduler.routing import NoWorkerError, RoutingPolicy
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
ROUTER_RECOVERY_S = 15.0
ROUTER_RETRY_S = 0.2
CAPACITY_REFRESH_S = 2.0   # how often the router's view of the workers is read for admission


def served_models(models: Mapping[str, str]) -> list[ServedModel]:
    """ServedModel (name, path, max_context) of each name -> checkpoint dir; reads headers only."""
    from actors.model_spec import ModelSpec

    return [ServedModel(name, str(path), ModelSpec.from_dir(path).max_position_embeddings)
            for name, path in models.items()]


class ClusterEngineClient:
    def __init__(self, router: Any, models: Mapping[str, str] | list[ServedModel], max_dispatches: int = 3,
                 router_source: Callable[[], Awaitable[Any]] | None = None,
                 router_recovery_s: float = ROUTER_RECOVERY_S) -> None:
        """`router_source()` gives the current router handle after the one held died; it is asked
        until a router answers or `router_recovery_s` passes. Without it a dead router fails
        each request."""
        if max_dispatches < 1:
            raise ValueError(f"max_dispatches must be >= 1, got {max_dispatches}")
        if router_recovery_s < 0:
            raise ValueError(f"router_recovery_s must be >= 0, got {router_recovery_s}")
        infos = served_models(models) if isinstance(models, Mapping) else list(models)
        if not infos:
            raise ValueError("ClusterEngineClient needs at least one model")
        self.router = router
        self._router_source = router_source
        self.router_recovery_s = router_recovery_s
        self._router_lost_at = float("-inf")   # loop time the router was last found gone
        self.max_dispatches = max_dispatches
        self._models = {m.name: m for m in infos}
        self._tokenizers = TokenizerCache()
        self._releases: set[asyncio.Task] = set()   # router releases in flight (held until done)
        self.num_redispatched = 0   # sent again before their first token
        self.num_resumed = 0        # continued on another worker after tokens were sent
        self._workers: RouterStatus | None = None    # the router's latest view, for start_rate
        self._workers_read_at = float("-inf")
        self._workers_reading: asyncio.Task | None = None

    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    def set_models(self, models: list[ServedModel]) -> None:
        """The models (serving keys) requests may name from now on (the live catalog's, through
        deploy/serve_app/catalog_client.py); requests in flight keep going."""
        self._models = {m.name: m for m in models}

    def tokenizer(self, model: str) -> Any:
        info = self._models.get(model)
        if info is None:
            raise ValueError(f"unknown model {model!r}; served: {sorted(self._models)}")
        return self._tokenizers.get(model, info.path)

    async def _tokenizer(self, model: str) -> Any:
        """The model's tokenizer; loaded off the event loop the first time (an unknown model
        has none: the worker refuses the request with its own message)."""
        if model not in self._models:
            return None
        return self._tokenizers.loaded(model) or await asyncio.to_thread(self.tokenizer, model)

    def start_rate(self, model: str) -> float | None:
        """Requests of `model` the cluster starts per second when they queue, at the speed its
        workers report (RoutingPolicy.start_rate over the router's view); None until the router
        has answered, or when no live worker holds the model. Never waits: the edge asks it for
        each request, and the view is read again in the background every CAPACITY_REFRESH_S."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._workers_read_at >= CAPACITY_REFRESH_S and self._workers_reading is None:
            self._workers_reading = loop.create_task(self.read_workers(), context=contextvars.Context())
        status = self._workers
        rate = None if status is None else RoutingPolicy().start_rate(model, status.workers.values())
        return rate or None

    async def read_workers(self, timeout_s: float = 5.0) -> None:
        """Read the router's view of the workers now (start_rate's); a router that does not answer
        leaves the last view."""
        try:
            self._workers = await asyncio.wait_for(self._router_call("status"), timeout_s)
        except Exception as exc:
            logger.info("reading the workers' speed from the router failed: %s", _cause(exc))
        finally:
            self._workers_read_at = asyncio.get_running_loop().time()
            self._workers_reading = None

    async def _router_call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.router, method).remote(*args)
        except _WORKER_GONE:
            if self._router_source is None:
                raise
        logger.warning("the router is gone; asking for the current one")
        deadline = asyncio.get_running_loop().time() + self.router_recovery_s
        self._router_lost_at = asyncio.get_running_loop().time()
        while True:   # restarted in place (same handle) or made again by the supervisor (a new one)
            try:
                self.router = await self._router_source()
                return await getattr(self.router, method).remote(*args)
            except _WORKER_GONE:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
            await asyncio.sleep(ROUTER_RETRY_S)

    async def _pick(self, model: str, slo: SLO, request_id: str, after_failure: bool = False) -> tuple[str, Any]:
        """A worker for the request. After a worker or the router died the model may have no
        worker for a moment (placement moving it, the router's table being rebuilt): asked
        again until `router_recovery_s` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.router_recovery_s
        while True:
            try:
                return await self._pick_once(model, slo, request_id)
            except ray.exceptions.RayTaskError as exc:
                recovering = after_failure or loop.time() - self._router_lost_at < self.router_recovery_s
                if not (recovering and isinstance(exc.cause, NoWorkerError) and loop.time() < deadline):
                    raise
            await asyncio.sleep(ROUTER_RETRY_S)

    async def _pick_once(self, model: str, slo: SLO, request_id: str) -> tuple[str, Any]:
        """One pick, counted under the request's id (a pick retried after a lost answer moves
        its count, see GlobalRouter.pick); a caller cancelled while the router answers still has
        its place released (the router counted the request as dispatched)."""
        pick = asyncio.ensure_future(self._router_call("pick", model, slo, request_id))
        try:
            return await asyncio.shield(pick)
        except asyncio.CancelledError:
            pick.add_done_callback(lambda done: self._release_unused(done, model, request_id))
            raise

    def _release_unused(self, pick: asyncio.Future, model: str, request_id: str) -> None:
        if not pick.cancelled() and pick.exception() is None:
            worker_id, _ = pick.result()
            self._release(worker_id, model, request_id)

    def _release(self, worker_id: str, model: str, request_id: str) -> None:
        """Give the request's place back at the router, from a task of its own (a finally must
        not block on it), awaited and retried on the current router like every router call.

        The task runs in a fresh contextvars context. In the request's own context Ray counts the
        release as a child task of the request's Serve call, and when the client disconnects
        Serve cancels that call recursively: the release was cancelled before it ran, and the
        router kept the abandoned request's count for good (1 in 3 chaos runs)."""
        task = asyncio.get_running_loop().create_task(self._release_now(worker_id, model, request_id),
                                                      context=contextvars.Context())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_now(self, worker_id: str, model: str, request_id: str) -> None:
        try:
            await self._router_call("release", worker_id, model, request_id)
        except Exception as exc:   # the router is gone for good: its successor starts from zero
            logger.warning("releasing %s on %s at the router failed: %s", request_id, worker_id, _cause(exc))

    async def servable_models(self, timeout_s: float = 5.0) -> list[str]:
        """The served models some live worker can take now (for /health); none when the router
        does not answer within `timeout_s`."""
        try:
            status = await asyncio.wait_for(self._router_call("status"), timeout_s)
        except Exception as exc:   # the router is gone or wedged: nothing is known to serve
            logger.warning("health: the router did not answer: %s", _cause(exc))
            return []
        live = [v for v in status.workers.values() if v.alive]   # a RouterStatus
        registered = set().union(*(v.registered for v in live)) if live else set()
        return sorted(registered & set(self._models))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputFrame]:
        text = TextAssembler(await self._tokenizer(req.model), req.prompt_token_ids, req.sampling_params.stop)
        sent = _Sent([], [], 0)   # what the client has: resumed from here on a worker death
        tried: list[str] = []
        for _ in range(self.max_dispatches):
            try:
                worker_id, handle = await self._pick(req.model, req.slo, req.request_id, after_failure=bool(tried))
            except Exception as exc:  # NoWorkerError (a RayTaskError), or the router is gone
                yield _error(req, f"no worker can serve model {req.model!r}: {_cause(exc)}"
                                  + (f"; {len(sent.token_ids)} tokens were sent" if sent.token_ids else ""))
                return
            tried.append(worker_id)
            try:
                stream = await self._open(worker_id, handle, req, sent)
            except _WORKER_GONE:   # its place first: cancelled while reporting, it would be kept
                self._release(worker_id, req.model, req.request_id)
                await self._worker_failed(worker_id, req, sent)
                continue
            except ValueError as exc:   # the worker refused to adopt it (an unknown model, a bad state)
                self._release(worker_id, req.model, req.request_id)
                yield _error(req, f"worker {worker_id} could not continue the request: {exc}", worker_id)
                return
            except BaseException:   # cancelled while the worker adopted it: its place is returned
                self._release(worker_id, req.model, req.request_id)
                raise
            try:
                async with stream:   # left early (closed or cancelled): the stream stops the worker's work
                    async for frame in stream:
                        sent.add(text.fill(frame))
                        yield frame
                        if frame.finished:
                            return
                yield _error(req, f"worker {stream.worker_id} ended the stream without a finish reason")
                return
            except _WORKER_GONE:   # the worker read from now: the decode worker after a handoff
                tried[-1] = stream.worker_id
                await self._worker_failed(stream.worker_id, req, sent)
            except ray.exceptions.TaskCancelledError:
                return  # cancelled with its consumer
            except ray.exceptions.RayTaskError as exc:
                yield _error(req, f"worker {stream.worker_id} failed: {_cause(exc)}", stream.worker_id)
                return
            finally:
                self._release(worker_id, req.model, req.request_id)   # in the background: never block a finally
        yield _error(req, f"request {req.request_id} failed on {len(tried)} workers that died: {tried}"
                          + (f"; {len(sent.token_ids)} tokens were sent" if sent.token_ids else ""))

    async def _open(self, worker_id: str, handle: Any, req: GenerateRequest, sent: "_Sent") -> FrameStream:
        """The request's frame stream on `handle`: from the start, or adopted with what was sent."""
        if not sent.token_ids:
            return stream_frames(handle.generate.remote(req), worker_id)
        # A new id on the worker: a prefill worker that died during a handoff may have left this
        # very worker an adopted copy under the old id, held until its stream-wait runs out.
        sent.num_resumes += 1
        resumed = dataclasses.replace(req, request_id=f"{req.request_id}.resume{sent.num_resumes}")
        state = HandoffState.continuing(resumed, sent.token_ids, sent.token_times, sent.num_chars)
        ack = await handle.adopt_prefilled.remote(state, None)   # no KV: the worker recomputes the prefix
        if not ack.adopted and ack.error:
            raise ValueError(ack.error)
        # opened with no await after the ack: the adopted request's frames wait in its buffer
        return stream_frames(handle.generate_prefilled.remote(resumed.request_id), worker_id)

    async def _worker_failed(self, worker_id: str, req: GenerateRequest, sent: "_Sent") -> None:
        if sent.token_ids:
            logger.warning("worker %s died mid-stream of %s after %d tokens: resuming elsewhere",
                           worker_id, req.request_id, len(sent.token_ids))
            self.num_resumed += 1
        else:
            logger.warning("worker %s died before %s produced a token: re-dispatching", worker_id, req.request_id)
            self.num_redispatched += 1
        try:
            await self._router_call("report_failure", worker_id)
        except Exception as exc:   # the router is down too: the pick that follows waits for it
            logger.info("reporting %s to the router failed: %s", worker_id, _cause(exc))


@dataclasses.dataclass
class _Sent:
    """What the client of one request has: the output a resumed request starts from."""

    token_ids: list[int]
    token_times: list[float]
    num_chars: int
    num_resumes: int = 0

    def add(self, frame: OutputFrame) -> None:
        self.token_ids += frame.token_ids
        self.token_times += frame.token_times
        self.num_chars += len(frame.text)


def _error(req: GenerateRequest, message: str, worker_id: str | None = None) -> OutputFrame:
    return OutputFrame(req.request_id, finish_reason=FINISH_ERROR, error=message,
                       num_prompt_tokens=len(req.prompt_token_ids), worker_id=worker_id)


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
