"""A request's output as frames: its sampling generator and sent tokens (the engine's part),
and its text (wherever the text is made).

    OutputAssembler   on the engine thread, one per request: the tokens produced since the
                      last frame -> one OutputFrame (ids, times, finish), its text too when the
                      engine detokenises (EngineConfig.detokenize)
    TextAssembler     the text of one request's token stream: incremental detokenising, stop
                      strings cut, text that could still be the start of a stop string held back
                      until it is known not to be one (a client never sees part of a stop string)

A DeviceWorker's engine sends token ids only and the ingress makes the text
(deploy/serve_app/cluster_engine.py, `TextAssembler.fill`), as vLLM's engine core leaves
detokenising to its frontend process: on a small model, text cost as much per step as the
scheduling, and the worker's thread is the one every model on the device waits for. A stop
string then ends the request at the ingress, which drops the tokens after it and cancels
the stream (the worker aborts it); an engine that detokenises ends it itself.
"""
from __future__ import annotations

import random

import torch

from actors.detokenizer import IncrementalDetokenizer, find_stop
from scheduler.messages import OutputFrame
from scheduler.request import Request, RequestStatus

STOPPED = RequestStatus.FINISHED_STOPPED.finish_reason


class TextAssembler:
    def __init__(self, tokenizer, prompt_token_ids, stops=()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids))
        self.stops = tuple(stops)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.num_sent_chars = 0
        self._searched = 0   # text before this was searched for stops (a match would have ended it)

    def resume(self, output_token_ids, num_sent_chars: int | None = None) -> None:
        """Continue after output that reached the caller some other way: none of it is sent
        again (num_sent_chars: the text the caller has; None: all of it)."""
        self.detokenizer.step(list(output_token_ids))
        self.num_sent_chars = len(self.detokenizer.text) if num_sent_chars is None else num_sent_chars
        self._searched = len(self.detokenizer.text)

    def add(self, new_token_ids: list[int], finished: bool) -> tuple[str, int | None]:
        """The text delta of `new_token_ids` (the last ones when `finished`), and, when a stop
        string ended the output, how many of them it keeps (the one that completed it included)."""
        detokenizer = self.detokenizer
        if self.stops:   # token by token: which token completed a stop string
            for i, token in enumerate(new_token_ids):
                detokenizer.step([token])
                if finished and i == len(new_token_ids) - 1:
                    detokenizer.finish()
                cut = find_stop(detokenizer.text, self.stops, start=self._searched - self.holdback)
                self._searched = len(detokenizer.text)
                if cut is not None:
                    return self._send(cut), i + 1
            if finished and not new_token_ids:
                detokenizer.finish()
            text = detokenizer.text
            return self._send(len(text) if finished else len(text) - self.holdback), None
        detokenizer.step(new_token_ids)
        if finished:   # the last frame: a character cut off by the end becomes U+FFFD,
            detokenizer.finish()   # as tokenizer.decode(output_ids) gives it
        return self._send(len(detokenizer.text)), None

    def _send(self, end: int) -> str:
        start = self.num_sent_chars
        delta = self.detokenizer.text[start:end]
        self.num_sent_chars = max(start, end)
        return delta

    def cut(self, frame: OutputFrame, finished: bool) -> bool:
        """Give `frame` its text; a stop string in it drops the frame's tokens after the one
        that completed it. True when one did."""
        text, kept = self.add(frame.token_ids, finished)
        frame.text = text
        if kept is None:
            return False
        del frame.token_ids[kept:], frame.token_times[kept:]
        return True

    def fill(self, frame: OutputFrame) -> OutputFrame:
        """Give a frame of token ids (from an engine that does not detokenise) its text; a stop
        string in it cuts its tokens after the one that completed it and finishes it."""
        if self.cut(frame, frame.finished and frame.error is None):
            frame.finish_reason, frame.error = STOPPED, None
        return frame


class OutputAssembler:
    def __init__(self, tokenizer, request: Request, device: torch.device, detokenize: bool = True):
        params = request.sampling_params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            # One generator per request: its draws do not depend on who shares the batch.
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.text = TextAssembler(tokenizer, request.prompt_token_ids, params.stop) if detokenize else None
        self.num_sent_tokens = 0
        self.num_prompt_tokens = request.num_prompt_tokens

    @property
    def num_sent_chars(self) -> int:
        return self.text.num_sent_chars if self.text is not None else 0

    def resume(self, request: Request, num_sent_chars: int | None = None) -> None:
        """Continue a request whose output so far reached the caller from another worker:
        none of it is sent again (num_sent_chars: text the caller has; None: all of it)."""
        self.num_sent_tokens = len(request.output_token_ids)
        if self.text is not None:
            self.text.resume(request.output_token_ids, num_sent_chars)

    def frame(self, request: Request) -> tuple[OutputFrame, bool]:
        """The frame of tokens produced since the last call, and whether a stop string ended it."""
        sent = self.num_sent_tokens
        new_ids = request.output_token_ids[sent:]   # slices: already copies
        times = request.token_times[sent:]
        self.num_sent_tokens = sent + len(new_ids)
        finished = request.status.is_finished
        finish = request.status.finish_reason if finished else None
        frame = OutputFrame(request.request_id, new_ids, "", times, finish, num_prompt_tokens=self.num_prompt_tokens)
        return frame, self.text is not None and self.text.cut(frame, finished)
