"""The OpenAI-compatible ingress: a FastAPI app over an injected `EngineClient`.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (streaming as SSE `data: {...}` chunks ending in
`data: [DONE]`, or one JSON response). Every error is in the OpenAI shape
(`deploy/openai_api/errors.py`); a body above `max_body_bytes` is refused (413) before it
is read in full; a model too busy to start a request in time refuses it (429 with
Retry-After, `admission.py`) while every accepted one runs to its end or to a clear error
(`stall_timeout_s` without output stops it); with API keys set, every route but /health needs one (`auth.py`). The
OpenAPI spec (/openapi.json) carries the request schemas and error responses
(`openapi.py`). `OpenAIIngress` holds the logic without HTTP so the Serve deployment can
expose the same stream to in-cluster callers (`generate_frames`).
"""
from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.openai_api.admission import Admission
from deploy.openai_api.auth import APIKeyMiddleware
from deploy.openai_api.engine_protocol import EngineClient, EngineStream
from deploy.openai_api.errors import OpenAIError, from_validation_error, invalid, request_too_large, server_error
from deploy.openai_api.config import IngressConfig
from deploy.openai_api.openapi import add_request_schemas, error_responses, generate_route
from deploy.openai_api.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionRequest, CompletionResponse, ModelCard, ModelList)
from deploy.openai_api.stream import Endpoint, collect_response, sse_stream, stream_chunks
from deploy.openai_api.request_builder import build_generate_request, find_model, request_slo
from scheduler.messages import GenerateRequest
from deploy.openai_api.protocol import IngressRequest

logger = logging.getLogger(__name__)

_REQUEST_TYPES = {"completions": CompletionRequest, "chat.completions": ChatCompletionRequest}
_ID_PREFIXES = {"completions": "cmpl", "chat.completions": "chatcmpl"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


@dataclass(frozen=True)
class Admitted:
    """A request the edge accepted: parsed, tokenised, and handed to the engine, whose stream
    holds its admission ticket from then on (close `frames` to give its place back)."""

    parsed: CompletionRequest | ChatCompletionRequest
    request: GenerateRequest
    frames: EngineStream


class OpenAIIngress:
    """Parse, validate, tokenize and stream; no HTTP here."""

    def __init__(self, engine: EngineClient, config: IngressConfig | None = None) -> None:
        self.engine = engine
        self.config = config or IngressConfig()
        # An engine that knows its workers' speed (the cluster's) tells admission how fast it starts requests.
        self.admission = Admission(self.config.admission, engine_rate=engine.start_rate)

    def list_models(self) -> dict:
        cards = [ModelCard(id=m.name, max_model_len=m.max_context) for m in self.engine.models()]
        return ModelList(data=cards).model_dump()

    async def prepare(self, endpoint: Endpoint, body: bytes | str, arrived: float | None = None) -> "Admitted":
        """JSON body -> the request, admitted: its one admission decision, taken once the model and
        SLO are known and before any tokenising (under overload most requests are refused, and a
        refusal then costs no thread hop and no tokenizer work). Raises OpenAIError (4xx, 429).
        arrived: when the edge began reading it (admission's clock; default now), what its TTFT
        counts from. The ticket goes to the engine with the request: closing `Admitted.frames`
        (done by `chunks` and `collect_response`) gives the place back."""
        try:
            parsed = _REQUEST_TYPES[endpoint].model_validate_json(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        request_id = f"{_ID_PREFIXES[endpoint]}-{uuid.uuid4().hex}"
        model = find_model(self.engine, parsed.model).name   # an unknown model is a 404, and gets no queue
        ttft_s = request_slo(parsed, self.config).ttft_s
        # Late after the larger of its SLO and the server's: a client asking for 1 ms lowers no limit.
        ticket = self.admission.admit(model, ttft_s, arrived, late_after_s=max(ttft_s, self.config.default_slo.ttft_s))
        try:
            # Tokenizing (and the first tokenizer load) blocks: keep it off the event loop.
            gen_req = await anyio.to_thread.run_sync(build_generate_request, self.engine, self.config, request_id,
                                                     parsed)
        except BaseException:
            ticket.release()
            raise
        return Admitted(parsed, gen_req, self.engine.generate(gen_req, ticket))

    def chunks(self, admitted: "Admitted", endpoint: Endpoint, include_usage: bool) -> AsyncIterator[dict]:
        """The admitted request's stream chunks."""
        return stream_chunks(admitted.frames, admitted.request, endpoint, include_usage, self.config.stall_timeout_s)

    async def generate_frames(self, request: IngressRequest) -> AsyncIterator[dict]:
        """Entry point for in-cluster callers (a Serve handle with stream=True).

        Yields the same chunk dicts the SSE stream carries (always streamed, always with a
        final usage chunk); an error is one chunk `{"error": {...}, "status": <http status>}`
        that ends the stream.
        """
        endpoint = request.endpoint
        arrived = self.admission.clock()
        try:
            if endpoint not in _REQUEST_TYPES:   # Ray unpickles without the message's checks
                raise invalid(f"endpoint must be one of {sorted(_REQUEST_TYPES)}, got {endpoint!r}", param="endpoint")
            body = dict(request.body)
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            chunks = self.chunks(await self.prepare(endpoint, json.dumps(body), arrived), endpoint, include_usage=True)
        except OpenAIError as e:
            yield {**e.to_dict(), "status": e.status}
            return
        async with aclosing(chunks) as open_chunks:   # a caller that leaves closes the request now
            async for chunk in open_chunks:
                yield chunk


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `max_bytes` (from
    Content-Length before reading anything, else while the chunks arrive)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid(f"Content-Length must be a number of bytes, got {length!r}")
        if int(length) > max_bytes:
            raise request_too_large(int(length), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise request_too_large(size, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body, and the engine's stream under it, however the
    response ends. Starlette leaves a body cut at a send (the client left) suspended until
    garbage collection, and with it the request's abort, its admission ticket and the router's
    count of it; a body that never started (the client left first) would close nothing."""

    def __init__(self, content, frames: EngineStream, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.frames = frames

    async def __call__(self, scope, receive, send) -> None:
        async def receive_or_disconnect():
            # A receive that fails means the client's side is gone (Ray Serve raises
            # TaskCancelledError once its proxy cancelled the request): a disconnect, not a 500.
            try:
                return await receive()
            except Exception as exc:
                logger.debug("receive failed (%s): the client is gone", type(exc).__name__)
                return {"type": "http.disconnect"}

        try:
            await super().__call__(scope, receive_or_disconnect, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.frames.aclose()


async def _respond(ingress: OpenAIIngress, endpoint: Endpoint, request: Request) -> Response:
    arrived = ingress.admission.clock()
    admitted = await ingress.prepare(endpoint, await read_body(request, ingress.config.max_body_bytes), arrived)
    parsed, gen_req = admitted.parsed, admitted.request
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        # On disconnect Starlette cancels (or closes) this generator; engine_frames aborts.
        chunks = ingress.chunks(admitted, endpoint, include_usage)
        return ClosingStreamingResponse(sse_stream(chunks), admitted.frames, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Request-Id": gen_req.request_id})
    # Non-streaming: race the generation against the client hanging up.
    result: dict | None = None
    failure: OpenAIError | None = None
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            await _until_disconnected(request)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await collect_response(admitted.frames, gen_req, endpoint, ingress.config.stall_timeout_s)
        except OpenAIError as e:  # raised out of the group it would come wrapped in an ExceptionGroup
            failure = e
        finally:   # cancelled before it read a frame: the request still ends here
            with anyio.CancelScope(shield=True):
                await admitted.frames.aclose()
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if result is None:
        logger.info("client left before request %s finished", gen_req.request_id)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(result, headers={"X-Request-Id": gen_req.request_id})


async def _health(engine: EngineClient) -> JSONResponse:
    """200 while some model can be served (`unservable` lists the others), 503 when none can
    (no live worker, or the router is gone): a load balancer then sends traffic elsewhere."""
    served = sorted(m.name for m in engine.models())
    servable = [m for m in await engine.servable_models() if m in served]
    unservable = [m for m in served if m not in servable]
    ok = bool(servable)
    body = {"status": "ok" if ok else "unavailable", "num_models": len(served), "unservable": unservable}
    return JSONResponse(body, status_code=200 if ok else 503)


def _error_response(e: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status, headers=headers)


def build_ingress_app(engine: EngineClient, config: IngressConfig | None = None) -> FastAPI:
    ingress = OpenAIIngress(engine, config)
    app = FastAPI(title="tokenmux", summary="OpenAI-compatible API over a token-level multiplexed GPU pool")
    app.state.ingress = ingress
    if ingress.config.api_keys:
        app.add_middleware(APIKeyMiddleware, digests=ingress.config.api_keys)
    add_request_schemas(app, [CompletionRequest, ChatCompletionRequest])

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error_response(e, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(from_validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error_response(OpenAIError(e.status_code, str(e.detail)), headers=e.headers)   # 405: Allow

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in the ingress")
        return _error_response(server_error(f"internal error: {type(e).__name__}"))

    @app.get("/health", responses={503: {"description": "No model can be served now"}})
    async def health() -> Response:
        return await _health(engine)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def models() -> dict:
        return ingress.list_models()

    @app.post("/v1/completions", **generate_route(CompletionRequest, CompletionResponse, CompletionResponse))
    async def completions(request: Request) -> Response:
        return await _respond(ingress, "completions", request)

    @app.post("/v1/chat/completions",
              **generate_route(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(request: Request) -> Response:
        return await _respond(ingress, "chat.completions", request)

    return app
