"""Test doubles that speak the product's protocols (never shipped in product code)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import torch

from actors.output_stream import OutputAssembler
from deploy.openai_api.admission import Ticket
from deploy.openai_api.engine_protocol import EngineClient, ServedModel, TokenizerCache
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame
from scheduler.request import Request, RequestStatus


class FakeStream:
    """A fake engine's stream of one request, holding its ticket as EngineClient.generate asks:
    `first_token()` at its first frame, `release()` when it ends or is closed."""

    def __init__(self, frames: AsyncIterator[OutputFrame], ticket: Ticket | None) -> None:
        self._frames = frames
        self._ticket = ticket

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> OutputFrame:
        try:
            frame = await self._frames.__anext__()
        except BaseException:
            await self.aclose()
            raise
        if self._ticket is not None:
            self._ticket.first_token()
        return frame

    async def aclose(self) -> None:
        await self._frames.aclose()
        if self._ticket is not None:
            self._ticket.release()


class FakeEngineClient(EngineClient):
    """TEST DOUBLE, not an engine: emits the prompt's own token ids, cyclically.

    Output is deterministic (token k = prompt[k % len(prompt)]); it honours max_tokens,
    stop_token_ids and a stream closed early (its abort), and turns tokens into text with the worker's own
    OutputAssembler (the real detokenizer, stop strings cut and held back as a worker does). `seen`, `aborted`, `active` and `num_generated` let tests observe it.
    `fail_after_tokens` makes it fail once that many tokens were sent: with an error
    frame, or by raising when `fail_by_raising`.
    """

    worker_id = "fake-0"

    def __init__(self, models: list[ServedModel], tokens_per_frame: int = 2,
                 frame_interval_s: float = 0.0, fail_after_tokens: int | None = None,
                 fail_by_raising: bool = False) -> None:
        if tokens_per_frame <= 0:
            raise ValueError(f"tokens_per_frame must be positive, got {tokens_per_frame}")
        self._models = {m.name: m for m in models}
        self._tokenizers = TokenizerCache()
        self.tokens_per_frame = tokens_per_frame
        self.frame_interval_s = frame_interval_s
        self.fail_after_tokens = fail_after_tokens
        self.fail_by_raising = fail_by_raising
        self.seen: list[GenerateRequest] = []
        self.aborted: set[str] = set()
        self.active: set[str] = set()
        self.num_generated: dict[str, int] = {}

    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    def tokenizer(self, model: str) -> Any:
        info = self._models[model]
        return self._tokenizers.get(model, info.path)

    def generate(self, req: GenerateRequest, ticket: Ticket | None = None) -> FakeStream:
        return FakeStream(self.frames(req), ticket)

    async def frames(self, req: GenerateRequest) -> AsyncIterator[OutputFrame]:
        """The request's frames (what a subclass changes)."""
        self.seen.append(req)
        self.active.add(req.request_id)
        finished = False
        try:
            async for frame in self._frames(req):
                finished = frame.finished
                yield frame
        finally:   # closed or cancelled before its last frame: aborted, as a worker's stream is
            if not finished:
                self.aborted.add(req.request_id)
            self.active.discard(req.request_id)

    async def _frames(self, req: GenerateRequest) -> AsyncIterator[OutputFrame]:
        # The worker's own output path (actors/output_stream.py): incremental detokenising,
        # stop strings cut and held back; only the token source is fake.
        request = Request.from_generate_request(req)   # no EOS ids: the fake stops on length or stops
        assembler = OutputAssembler(self.tokenizer(req.model), request, torch.device("cpu"))
        prompt = req.prompt_token_ids
        while True:
            await asyncio.sleep(self.frame_interval_s)
            if self.fail_after_tokens is not None and request.num_output_tokens >= self.fail_after_tokens:
                if self.fail_by_raising:
                    raise RuntimeError("fake engine failure")
                yield OutputFrame(req.request_id, finish_reason=FINISH_ERROR, error="fake engine failure",
                                  num_prompt_tokens=len(prompt), worker_id=self.worker_id)
                return
            for _ in range(self.tokens_per_frame):
                token = prompt[request.num_output_tokens % len(prompt)]
                request.output_token_ids.append(token)
                request.token_times.append(time.time())
                status = request.check_stop(token)
                if status is not None:
                    request.status = status
                    break
            self.num_generated[req.request_id] = request.num_output_tokens
            frame, stopped = assembler.frame(request)
            if stopped and not request.is_finished:   # a stop string ended it, as in the engine
                request.status = RequestStatus.FINISHED_STOPPED
                frame.finish_reason = request.status.finish_reason
            frame.worker_id = self.worker_id
            yield frame
            if request.is_finished:
                return
