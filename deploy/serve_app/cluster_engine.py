"""ClusterEngineClient: the real `EngineClient` of the ingress (router + DeviceWorkers).

One request: `router.pick(model, slo)` -> `(worker_id, handle)`, then stream
`handle.generate(req)` (a Ray streaming generator of OutputFrames, several tokens per
frame, read through actors/frame_stream.py's `stream_frames`), then `router.release` when
it ends, however it ends. The router sits on one
call per request; the tokens flow worker -> ingress directly.

Failures: a worker that dies before the request produced a token is reported to the
router (`report_failure`, which drops it from routing) and the request goes to another
worker; after tokens were produced, re-running it would repeat or change text the client
already has, so it ends with an error frame instead — nothing is silently lost.
`abort(request_id)` cancels the request's frame stream, as leaving the stream early does;
the worker aborts the request and frees its KV blocks when its consumer goes away.

Never `ray.get` here: everything is awaited on the ingress's event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from actors.frame_stream import FrameStream, stream_frames
from deploy.openai_api.engine_protocol import ModelInfo, TokenizerCache
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


def model_infos(models: Mapping[str, str]) -> list[ModelInfo]:
    """ModelInfo (name, path, max_context) of each name -> checkpoint dir; reads headers only."""
    from actors.model_spec import ModelSpec

    return [ModelInfo(name, str(path), ModelSpec.from_dir(path).max_position_embeddings)
            for name, path in models.items()]


class ClusterEngineClient:
    def __init__(self, router: Any, models: Mapping[str, str] | list[ModelInfo], max_dispatches: int = 3,
                 router_source: Callable[[], Awaitable[Any]] | None = None) -> None:
        """`router_source()` gives the current router handle after the one held died (the
        topology's owner was restarted); without it a dead router fails each request."""
        if max_dispatches < 1:
            raise ValueError(f"max_dispatches must be >= 1, got {max_dispatches}")
        infos = model_infos(models) if isinstance(models, Mapping) else list(models)
        if not infos:
            raise ValueError("ClusterEngineClient needs at least one model")
        self.router = router
        self._router_source = router_source
        self.max_dispatches = max_dispatches
        self._models = {m.name: m for m in infos}
        self._tokenizers = TokenizerCache()
        self._streams: dict[str, FrameStream] = {}  # request_id -> the worker's frame stream
        self.num_redispatched = 0

    def models(self) -> list[ModelInfo]:
        return list(self._models.values())

    def tokenizer(self, model: str) -> Any:
        info = self._models.get(model)
        if info is None:
            raise ValueError(f"unknown model {model!r}; served: {sorted(self._models)}")
        return self._tokenizers.get(model, info.path)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()  # non-blocking: the worker's generator gets CancelledError and aborts

    async def _router_call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.router, method).remote(*args)
        except _WORKER_GONE:
            if self._router_source is None:
                raise
            logger.warning("the router is gone; asking for the current one")
            self.router = await self._router_source()
            return await getattr(self.router, method).remote(*args)

    async def _pick(self, model: str, slo: SLO) -> tuple[str, Any]:
        return await self._router_call("pick", model, slo)

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
        tried: list[str] = []
        for _ in range(self.max_dispatches):
            try:
                worker_id, handle = await self._pick(req.model, req.slo)
            except Exception as exc:  # NoWorkerError (a RayTaskError), or the router is gone
                yield _error(req, f"no worker can serve model {req.model!r}: {_cause(exc)}")
                return
            tried.append(worker_id)
            produced = False
            stream = stream_frames(handle.generate.remote(req))
            self._streams[req.request_id] = stream
            try:
                async with stream:   # left early (closed or cancelled): the stream stops the worker's work
                    async for frame in stream:
                        produced = produced or bool(frame.token_ids or frame.text)
                        yield frame
                        if frame.finished:
                            return
                yield _error(req, f"worker {worker_id} ended the stream without a finish reason")
                return
            except _WORKER_GONE as exc:
                if produced:
                    logger.warning("worker %s died mid-stream of %s: %s", worker_id, req.request_id, exc)
                    yield _error(req, f"worker {worker_id} died after the request produced tokens; "
                                      f"partial output was kept: {_cause(exc)}", worker_id)
                    return
                logger.warning("worker %s died before %s produced a token: re-dispatching",
                               worker_id, req.request_id)
                await self.router.report_failure.remote(worker_id)
                self.num_redispatched += 1
            except ray.exceptions.TaskCancelledError:
                return  # aborted by us; the consumer is gone
            except ray.exceptions.RayTaskError as exc:
                yield _error(req, f"worker {worker_id} failed: {_cause(exc)}", worker_id)
                return
            finally:
                if self._streams.get(req.request_id) is stream:
                    del self._streams[req.request_id]
                self.router.release.remote(worker_id, req.model)  # fire and forget: never block a finally
        yield _error(req, f"request {req.request_id} failed on {len(tried)} workers that died: {tried}")


def _error(req: GenerateRequest, message: str, worker_id: str | None = None) -> OutputFrame:
    return OutputFrame(req.request_id, finish_reason=FINISH_ERROR, error=message,
                       num_prompt_tokens=len(req.prompt_token_ids), worker_id=worker_id)


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
