"""ClusterEngineClient: the real `EngineClient` of the ingress (router + DeviceWorkers).

One request: `router.pick(model, slo)` -> a `WorkerPick` (worker_id, handle), then stream
`handle.generate(req)` (a Ray streaming generator of OutputFrames, several tokens per
frame, read through actors/frame_stream.py's `stream_frames`), then `router.release` when
it ends, however it ends. The router sits on one call per request; the tokens flow worker ->
ingress directly. Workers send token ids; the text is made here (actors/output_stream.py's
TextAssembler, one per request, kept across a resume), stop strings included: a stop string
ends the stream here, the tokens after it are dropped and the worker's stream cancelled (it
aborts the request).

Each request is one `RequestState` (deploy/serve_app/request_state.py), made by `generate`
and advanced by `next_frame`: its admission ticket, the output the client has, the stream read
now, the workers tried and its one RetryBudget. Everything here that waits on a failure waits
under that budget's one deadline (RECOVERY_DEADLINE_S, `recovery_s`), so the time from a lost
worker to an error frame is that number, not a product of loops.

Failures: a worker that dies is reported to the router (`report_failure`, which drops it
from routing) and the request goes on on another worker. Before its first token it is
simply sent again; after, it is *resumed*: the new worker adopts it with the output the
client already has (a HandoffState without KV: prompt + output recomputed in one prefill,
the text already sent not sent again, max_tokens and stop strings counted over the whole
output, a seeded generator advanced past the tokens drawn), so the client's stream goes on
as if nothing happened; greedy output equals an undisturbed run's. A request that cannot
go on (no worker left, `max_dispatches` deaths, the deadline passed) ends with an error
frame, never a silent cut. A router that dies is asked for again (`router_source`) until
it answers or the deadline passes: the supervisor restarts it and rebuilds its table.
One abort path: a consumer that leaves early (closes or cancels the RequestState) cancels
the worker's frame stream, and the worker aborts the request and frees its KV blocks when
its consumer goes away. A request handed from a prefill to a decode worker
(actors/handoff.py) is read from the decode worker directly from then on (`stream_frames`
follows the handoff); the worker it is read from is the one blamed if the stream breaks.

Never `ray.get` here: everything is awaited on the ingress's event loop.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.frame_stream import FrameStream, stream_frames
from actors.output_stream import TextAssembler
from cluster.router import WorkerPick
from deploy.openai_api.admission import Ticket
from deploy.openai_api.engine_protocol import EngineClient, ServedModel, TokenizerCache
from deploy.serve_app.request_meter import RequestMeter
from deploy.serve_app.request_state import RECOVERY_DEADLINE_S, DeadlinePassed, RequestState, RetryBudget
from scheduler.messages import GenerateRequest, OutputFrame
from cluster.status import RouterStatus
from scheduler.routing import NoWorkerError, RoutingPolicy

logger = logging.getLogger(__name__)

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
CAPACITY_REFRESH_S = 2.0   # how often the router's view of the workers is read for admission
T = TypeVar("T")


class _CannotGoOn(Exception):
    """The request ends with this message as its error frame."""

    def __init__(self, message: str, worker_id: str | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id


def served_models(models: Mapping[str, str]) -> list[ServedModel]:
    """ServedModel (name, path, max_context) of each name -> checkpoint dir; reads headers only."""
    from actors.model_spec import ModelSpec

    return [ServedModel(name, str(path), ModelSpec.from_dir(path).max_position_embeddings)
            for name, path in models.items()]


class ClusterEngineClient(EngineClient):
    def __init__(self, router: Any, models: Mapping[str, str] | list[ServedModel], max_dispatches: int = 3,
                 router_source: Callable[[], Awaitable[Any]] | None = None,
                 recovery_s: float = RECOVERY_DEADLINE_S, meter: RequestMeter | None = None) -> None:
        """`router_source()` gives the current router handle after the one held died; it is asked
        until a router answers or the request's deadline passes. Without it a dead router fails
        each request. `recovery_s`: the deadline (see the module's docstring); `max_dispatches`:
        workers one request is sent to at most; `meter`: records each request as it ends."""
        RetryBudget(max_dispatches, recovery_s)   # the checks of both
        infos = served_models(models) if isinstance(models, Mapping) else list(models)
        if not infos:
            raise ValueError("ClusterEngineClient needs at least one model")
        self.router = router
        self._router_source = router_source
        self.recovery_s = recovery_s
        self.meter = meter
        self._router_lost_at = float("-inf")   # time.monotonic() the router was last found gone
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
            self._workers = await self._status(timeout_s)
        except Exception as exc:
            logger.info("reading the workers' speed from the router failed: %s", _cause(exc))
        finally:
            self._workers_read_at = asyncio.get_running_loop().time()
            self._workers_reading = None

    async def servable_models(self, timeout_s: float = 5.0) -> list[str]:
        """The served models some live worker can take now (for /health); none when the router
        does not answer within `timeout_s`."""
        try:
            status = await self._status(timeout_s)
        except Exception as exc:   # the router is gone or wedged: nothing is known to serve
            logger.warning("health: the router did not answer: %s", _cause(exc))
            return []
        live = [v for v in status.workers.values() if v.alive]   # a RouterStatus
        registered = set().union(*(v.registered for v in live)) if live else set()
        return sorted(registered & set(self._models))

    # ---- one request ---------------------------------------------------------------------

    def generate(self, req: GenerateRequest, ticket: Ticket | None = None) -> RequestState:
        """The request's frames, as its RequestState; it holds `ticket` from now on (released
        once, when the request ends or the state is closed, iterated or not)."""
        return RequestState(req, self, RetryBudget(self.max_dispatches, self.recovery_s), ticket)

    async def next_frame(self, state: RequestState) -> OutputFrame:
        """The request's next frame: from the stream read now, from a worker found for it (sent
        again, or resumed after a loss), or its error frame. Bounded: each turn reads a frame or
        spends one of the budget's dispatches."""
        req = state.request
        if state.text is None:
            state.text = TextAssembler(await self._tokenizer(req.model), req.prompt_token_ids,
                                       req.sampling_params.stop)
        try:
            for _ in range(state.budget.max_attempts + 1):
                if state.stream is None and not await self._dispatch(state):
                    continue   # the worker died while adopting it
                stream = state.stream
                try:
                    frame = await stream.__anext__()
                except StopAsyncIteration:
                    raise _CannotGoOn(f"worker {stream.worker_id} ended the stream without a finish reason")
                except _WORKER_GONE:   # the worker read from now: the decode worker after a handoff
                    state.tried[-1] = stream.worker_id
                    await self._lost(state, stream.worker_id)
                    continue
                except ray.exceptions.TaskCancelledError:
                    raise StopAsyncIteration from None   # cancelled with its consumer
                except ray.exceptions.RayTaskError as exc:
                    raise _CannotGoOn(f"worker {stream.worker_id} failed: {_cause(exc)}", stream.worker_id)
                return state.sent(frame)
            raise AssertionError("unreachable: _dispatch ends the request once its dispatches are spent")
        except _CannotGoOn as exc:
            return state.error(str(exc), exc.worker_id)

    async def _dispatch(self, state: RequestState) -> bool:
        """Open the request's stream on a worker the router picks, within its budget: True when
        open, False when that worker died meanwhile (reported; a dispatch was spent)."""
        req, budget = state.request, state.budget
        budget.need_worker()
        if not budget.attempt():
            raise _CannotGoOn(f"request {req.request_id} failed on {len(state.tried)} workers that died: "
                              f"{state.tried}")
        try:
            pick = await self._ask_router(budget, lambda router: self._pick_on(router, req),
                                          wait_for_worker=bool(state.tried))
        except Exception as exc:   # NoWorkerError (a RayTaskError), the router gone, or the deadline
            raise _CannotGoOn(f"no worker can serve model {req.model!r}: {_cause(exc)}") from None
        state.place = pick
        state.tried.append(pick.worker_id)
        try:
            state.stream = await self._open(state, pick)
        except _WORKER_GONE:
            await self._lost(state, pick.worker_id)
            return False
        except (ValueError, ray.exceptions.RayTaskError, DeadlinePassed) as exc:   # refused to adopt it
            raise _CannotGoOn(f"worker {pick.worker_id} could not continue the request: {_cause(exc)}",
                              pick.worker_id) from None
        return True

    async def _open(self, state: RequestState, pick: WorkerPick) -> FrameStream:
        """The request's frame stream on the picked worker: from the start, or adopted with what
        the client has (no KV: the worker recomputes the prefix)."""
        if not state.output_token_ids:
            return stream_frames(pick.handle.generate.remote(state.request), pick.worker_id)
        handoff = state.continuing()
        ack = await state.budget.bounded(_awaited(pick.handle.adopt_prefilled.remote(handoff, None)))
        if not ack.adopted and ack.error:
            raise ValueError(ack.error)
        # opened with no await after the ack: the adopted request's frames wait in its buffer
        return stream_frames(pick.handle.generate_prefilled.remote(handoff.request.request_id), pick.worker_id)

    async def _lost(self, state: RequestState, worker_id: str) -> None:
        """The worker serving the request died: its place is given back, the router told, and the
        deadline runs until another worker streams it."""
        state.stream = None
        self._release_place(state)
        state.budget.need_worker()
        if state.output_token_ids:
            logger.warning("worker %s died mid-stream of %s after %d tokens: resuming elsewhere",
                           worker_id, state.request.request_id, len(state.output_token_ids))
            self.num_resumed += 1
        else:
            logger.warning("worker %s died before %s produced a token: re-dispatching", worker_id,
                           state.request.request_id)
            self.num_redispatched += 1
        try:
            await self._ask_router(state.budget, lambda router: _awaited(router.report_failure.remote(worker_id)))
        except Exception as exc:   # the router is down too: the pick that follows waits for it
            logger.info("reporting %s to the router failed: %s", worker_id, _cause(exc))

    def request_ended(self, state: RequestState) -> None:
        """A request's last frame went out, or it was closed: its place back, its outcome metered."""
        self._release_place(state)
        if self.meter is not None:
            self.meter.record(state.request, state.outcome, state.token_times)

    # ---- the router ----------------------------------------------------------------------

    async def _ask_router(self, budget: RetryBudget, call: Callable[[Any], Awaitable[T]],
                          wait_for_worker: bool = False) -> T:
        """`call(router)`, cut at the budget's deadline and tried again until then while the router
        is being remade (a dead one: `router_source` gives its successor) or, after a worker or
        the router was lost, while it has no worker for the model yet (placement moving it, its
        table being rebuilt)."""
        budget.need_worker()
        while not budget.expired:
            try:
                return await budget.bounded(call(self.router))
            except _WORKER_GONE:
                if self._router_source is None:
                    raise
                logger.warning("the router is gone; asking for the current one")
                self._router_lost_at = time.monotonic()
                try:   # restarted in place (same handle) or made again by the supervisor (a new one)
                    self.router = await budget.bounded(self._router_source())
                except _WORKER_GONE:
                    pass
            except ray.exceptions.RayTaskError as exc:
                recovering = wait_for_worker or time.monotonic() - self._router_lost_at < self.recovery_s
                if not (recovering and isinstance(exc.cause, NoWorkerError)):
                    raise
            await budget.pause()
        raise DeadlinePassed(f"the router did not answer within {budget.recovery_s:g} s")

    async def _pick_on(self, router: Any, req: GenerateRequest) -> WorkerPick:
        """One pick, counted under the request's id (a pick retried after a lost answer moves its
        count, see GlobalRouter.pick); a caller cancelled while the router answers (the deadline,
        or its consumer) still has its place released: the router counted the request."""
        pick = asyncio.ensure_future(_awaited(router.pick.remote(req.model, req.slo, req.request_id)))
        try:
            return await asyncio.shield(pick)
        except asyncio.CancelledError:
            pick.add_done_callback(lambda done: self._release_unused(done, req))
            raise

    def _release_unused(self, pick: asyncio.Future, req: GenerateRequest) -> None:
        if not pick.cancelled() and pick.exception() is None:
            self._release(pick.result().worker_id, req)

    def _release_place(self, state: RequestState) -> None:
        place, state.place = state.place, None
        if place is not None:
            self._release(place.worker_id, state.request)

    def _release(self, worker_id: str, req: GenerateRequest) -> None:
        """Give the request's place back at the router, from a task of its own (an end must not
        block on it), under a deadline of its own like every router call.

        The task runs in a fresh contextvars context. In the request's own context Ray counts the
        release as a child task of the request's Serve call, and when the client disconnects
        Serve cancels that call recursively: the release was cancelled before it ran, and the
        router kept the abandoned request's count for good (1 in 3 chaos runs)."""
        task = asyncio.get_running_loop().create_task(self._release_now(worker_id, req),
                                                      context=contextvars.Context())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_now(self, worker_id: str, req: GenerateRequest) -> None:
        budget = RetryBudget(1, self.recovery_s)
        try:
            await self._ask_router(budget, lambda router: _awaited(
                router.release.remote(worker_id, req.model, req.request_id)))
        except Exception as exc:   # the router is gone for good: its successor starts from zero
            logger.warning("releasing %s on %s at the router failed: %s", req.request_id, worker_id, _cause(exc))

    async def _status(self, timeout_s: float) -> RouterStatus:
        return await self._ask_router(RetryBudget(1, timeout_s), lambda router: _awaited(router.status.remote()))


async def _awaited(ref: Any) -> Any:
    """A Ray ObjectRef as a coroutine (what asyncio.wait_for and shield take)."""
    return await ref


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
