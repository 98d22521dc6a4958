"""OutputFrames -> OpenAI chunks (streaming) or one response (non-streaming), and SSE.

One engine frame (several tokens) becomes one chunk; each chunk carries the frame's
token ids and per-token times under the `tokenmux` key. With
`stream_options.include_usage` a last chunk with empty `choices` carries `usage`.
A failure in the engine becomes an `{"error": ...}` chunk ending the stream, never an
exception through the HTTP layer. If the consumer goes away before the last frame
(client disconnect, cancelled task, closed generator) the engine's stream is closed, which
aborts the request there. A
request that gets no frame for `stall_timeout_s` (a wedged worker, a lost reply) is
aborted and ends with an error saying so; closing the engine's stream releases its
admission ticket (the engine holds it, EngineClient.generate).
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Literal

import anyio

from deploy.openai_api.engine_protocol import EngineStream
from deploy.openai_api.errors import OpenAIError, server_error
from deploy.openai_api.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                    ChatDelta, ChatResponseMessage, CompletionChoice, CompletionResponse,
                                    TokenmuxExtension, Usage)
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame

logger = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat.completions"]
SSE_DONE = "data: [DONE]\n\n"
_UNFINISHED = "generation failed: the engine ended the stream without a finish reason"


def sse_event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def stalled(req: GenerateRequest, stall_timeout_s: float) -> OutputFrame:
    return OutputFrame(req.request_id, finish_reason=FINISH_ERROR,
                       error=f"timed out: no output for {stall_timeout_s:g} s, so tokenmux stopped the request "
                             f"(the ingress's stall_timeout_s)")


async def engine_frames(frames: EngineStream, req: GenerateRequest,
                        stall_timeout_s: float | None = None) -> AsyncIterator[OutputFrame]:
    """The request's frames up to and including the finished one; closes `frames` at the end,
    which aborts the request if it is left early or when no frame comes for `stall_timeout_s`
    (then the last frame is that error)."""
    finished = False
    try:
        while not finished:
            frame = None
            with anyio.move_on_after(stall_timeout_s):   # None: wait for ever
                try:
                    frame = await frames.__anext__()
                except StopAsyncIteration:
                    break
            if frame is None:   # the deadline passed: abort below, tell the client
                logger.warning("request %s: no output for %g s, stopping it", req.request_id, stall_timeout_s)
                yield stalled(req, stall_timeout_s)
                break
            finished = frame.finished
            yield frame
    finally:
        # The one abort: closing the engine's stream before its last frame stops the request
        # there (EngineClient.generate), and gives back its places. Shielded: under a cancelled
        # anyio scope (Starlette on disconnect) any await would be cancelled again before the
        # close reaches the engine.
        with anyio.CancelScope(shield=True):
            if not finished:
                logger.info("request %s left before it finished: aborting", req.request_id)
            await frames.aclose()


def _usage(req: GenerateRequest, num_completion_tokens: int) -> Usage:
    num_prompt_tokens = len(req.prompt_token_ids)
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                 total_tokens=num_prompt_tokens + num_completion_tokens)


def _ext(frame: OutputFrame) -> TokenmuxExtension:
    return TokenmuxExtension(token_ids=frame.token_ids, token_times=frame.token_times, worker_id=frame.worker_id)


def _error_chunk(message: str) -> dict:
    return server_error(message).to_dict()


async def stream_chunks(frames: EngineStream, req: GenerateRequest, endpoint: Endpoint,
                        include_usage: bool = False, stall_timeout_s: float | None = None) -> AsyncIterator[dict]:
    """OpenAI stream chunks as dicts (the SSE payloads, without `[DONE]`) of the engine's `frames`."""
    created = int(time.time())
    num_completion_tokens = 0
    first = True
    finish_reason = None
    try:
        # aclosing: the frames' cleanup (abort, ticket) is done before the stream's end is sent
        async with aclosing(engine_frames(frames, req, stall_timeout_s)) as checked:
            async for frame in checked:
                finish_reason = frame.finish_reason
                if frame.error is not None:
                    yield _error_chunk(f"generation failed: {frame.error}")
                    return
                num_completion_tokens += len(frame.token_ids)
                if endpoint == "completions":
                    choice = CompletionChoice(text=frame.text, finish_reason=frame.finish_reason)
                    chunk = CompletionResponse(id=req.request_id, created=created, model=req.model,
                                               system_fingerprint=frame.model_version, tokenmux=_ext(frame),
                                               choices=[choice])
                else:
                    delta = ChatDelta(role="assistant" if first else None, content=frame.text)
                    choice = ChatChunkChoice(delta=delta, finish_reason=frame.finish_reason)
                    chunk = ChatCompletionChunk(id=req.request_id, created=created, model=req.model,
                                                system_fingerprint=frame.model_version, tokenmux=_ext(frame),
                                                choices=[choice])
                first = False
                yield chunk.model_dump()
    except Exception as e:  # an engine failure is a value in the stream
        logger.exception("request %s failed in the engine", req.request_id)
        yield _error_chunk(f"generation failed: {e}")
        return
    if finish_reason is None:
        yield _error_chunk(_UNFINISHED)
        return
    if include_usage:
        usage = _usage(req, num_completion_tokens)
        cls = CompletionResponse if endpoint == "completions" else ChatCompletionChunk
        yield cls(id=req.request_id, created=created, model=req.model, choices=[], usage=usage).model_dump()


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    # aclosing: when Starlette stops sending (the client left while a chunk was on its way), the
    # chunks' cleanup (abort, admission ticket, the router's place) runs now, not at garbage collection
    async with aclosing(chunks) as open_chunks:
        async for chunk in open_chunks:
            yield sse_event(chunk)
    yield SSE_DONE


async def collect_response(frames: EngineStream, req: GenerateRequest, endpoint: Endpoint,
                           stall_timeout_s: float | None = None) -> dict:
    """The whole (non-streaming) response of the engine's `frames`; raises a 500 OpenAIError if
    the engine fails."""
    text: list[str] = []
    ext = TokenmuxExtension()
    finish_reason = None
    version = None
    try:
        async with aclosing(engine_frames(frames, req, stall_timeout_s)) as checked:
            async for frame in checked:
                if frame.error is not None:
                    raise server_error(f"generation failed: {frame.error}")
                text.append(frame.text)
                ext.token_ids.extend(frame.token_ids)
                ext.token_times.extend(frame.token_times)
                ext.worker_id = frame.worker_id or ext.worker_id
                version = frame.model_version or version
                finish_reason = frame.finish_reason
    except OpenAIError:
        raise
    except Exception as e:
        logger.exception("request %s failed in the engine", req.request_id)
        raise server_error(f"generation failed: {e}") from e
    if finish_reason is None:
        raise server_error(_UNFINISHED)
    usage = _usage(req, len(ext.token_ids))
    created = int(time.time())
    if endpoint == "completions":
        choice = CompletionChoice(text="".join(text), finish_reason=finish_reason)
        return CompletionResponse(id=req.request_id, created=created, model=req.model, choices=[choice],
                                  usage=usage, system_fingerprint=version, tokenmux=ext).model_dump()
    choice = ChatChoice(message=ChatResponseMessage(content="".join(text)), finish_reason=finish_reason)
    return ChatCompletionResponse(id=req.request_id, created=created, model=req.model, choices=[choice],
                                  usage=usage, system_fingerprint=version, tokenmux=ext).model_dump()
