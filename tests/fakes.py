"""Test doubles that speak the product's protocols (never shipped in product code)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from deploy.openai_api.engine_protocol import ModelInfo, TokenizerCache
from scheduler.messages import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerateRequest, OutputFrame


class FakeEngineClient:
    """TEST DOUBLE, not an engine: emits the prompt's own token ids, cyclically.

    Output is deterministic (token k = prompt[k % len(prompt)]); it honours max_tokens,
    stop strings (text is cut before the stop string, as OpenAI does), stop_token_ids and
    abort. `seen`, `aborted`, `active` and `num_generated` let tests observe it.
    `fail_after_tokens` makes it fail once that many tokens were sent: with an error
    frame, or by raising when `fail_by_raising`.
    """

    worker_id = "fake-0"

    def __init__(self, models: list[ModelInfo], tokens_per_frame: int = 2,
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

    def models(self) -> list[ModelInfo]:
        return list(self._models.values())

    def tokenizer(self, model: str) -> Any:
        info = self._models[model]
        return self._tokenizers.get(model, info.path)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[OutputFrame]:
        self.seen.append(req)
        self.active.add(req.request_id)
        try:
            async for frame in self._frames(req):
                yield frame
        finally:
            self.active.discard(req.request_id)

    async def _frames(self, req: GenerateRequest) -> AsyncIterator[OutputFrame]:
        tok = self.tokenizer(req.model)
        params = req.sampling_params
        prompt = req.prompt_token_ids
        hold_back = max((len(s) for s in params.stop), default=1) - 1
        output_ids: list[int] = []
        sent_text = ""
        while True:
            await asyncio.sleep(self.frame_interval_s)
            if req.request_id in self.aborted:
                return
            if self.fail_after_tokens is not None and len(output_ids) >= self.fail_after_tokens:
                if self.fail_by_raising:
                    raise RuntimeError("fake engine failure")
                yield OutputFrame(req.request_id, finish_reason=FINISH_ERROR, error="fake engine failure",
                                  num_prompt_tokens=len(prompt), worker_id=self.worker_id)
                return
            new_ids, new_times, finish = [], [], None
            while len(new_ids) < self.tokens_per_frame and finish is None:
                token = prompt[len(output_ids) % len(prompt)]
                output_ids.append(token)
                new_ids.append(token)
                new_times.append(time.time())
                if token in params.stop_token_ids:
                    finish = FINISH_STOP
                elif len(output_ids) >= params.max_tokens:
                    finish = FINISH_LENGTH
            self.num_generated[req.request_id] = len(output_ids)
            text = tok.decode(output_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
            if cuts:
                text, finish = text[: min(cuts)], FINISH_STOP
            ready = len(text) if finish else max(len(sent_text), len(text) - hold_back)
            while ready > len(sent_text) and not finish and text[ready - 1] == "\ufffd":
                ready -= 1  # an incomplete UTF-8 sequence: wait for its next byte
            delta, sent_text = text[len(sent_text):ready], text[:ready]
            yield OutputFrame(req.request_id, token_ids=new_ids, text=delta, token_times=new_times,
                              finish_reason=finish, num_prompt_tokens=len(prompt),
                              worker_id=self.worker_id)
            if finish:
                return
