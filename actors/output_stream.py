"""Per-request output state on the worker: sampling generator, detokeniser, stop strings.

Each step turns a request's newly sampled tokens into one OutputFrame: the token ids,
their times, and the text delta. Text that could still be the start of a stop string is
held back until it is known not to be one, so a client never sees part of a stop string.
"""
from __future__ import annotations

import random

import torch

from actors.detokenizer import IncrementalDetokenizer, find_stop
from scheduler.messages import OutputFrame
from scheduler.request import Request


class OutputAssembler:
    def __init__(self, tokenizer, request: Request, device: torch.device):
        params = request.sampling_params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            # One generator per request: its draws do not depend on who shares the batch.
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self.stops = params.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.num_prompt_tokens = request.num_prompt_tokens
        self._searched = 0   # text before this was searched for stops (a match would have ended it)

    def resume(self, request: Request, num_sent_chars: int | None = None) -> None:
        """Continue a request whose output so far reached the caller from another worker:
        none of it is sent again (num_sent_chars: text the caller has; None: all of it)."""
        self.num_sent_tokens = len(request.output_token_ids)
        self.detokenizer.step(request.output_token_ids)
        self.num_sent_chars = len(self.detokenizer.text) if num_sent_chars is None else num_sent_chars

    def frame(self, request: Request) -> tuple[OutputFrame, bool]:
        """The frame of tokens produced since the last call, and whether a stop string ended it."""
        sent = self.num_sent_tokens
        new_ids = request.output_token_ids[sent:]
        times = request.token_times[sent:]
        self.num_sent_tokens = sent + len(new_ids)
        detokenizer = self.detokenizer
        detokenizer.step(new_ids)
        finished = request.status.is_finished
        if finished:   # the last frame: a character cut off by the end becomes U+FFFD,
            detokenizer.finish()   # as tokenizer.decode(output_ids) gives it
        text = detokenizer.text
        stopped, end = False, len(text)
        if self.stops:
            # only a stop string ending in the new text can be new: search from where one could start
            cut = find_stop(text, self.stops, start=self._searched - self.holdback)
            self._searched = len(text)
            if cut is not None:
                end, stopped = cut, True
            elif not finished:
                end = max(self.num_sent_chars, len(text) - self.holdback)
        delta = text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        finish = request.status.finish_reason if finished else None
        frame = OutputFrame(request.request_id, new_ids, delta, times, finish,   # slices: already copies
                            num_prompt_tokens=self.num_prompt_tokens)
        return frame, stopped
