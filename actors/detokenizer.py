"""Streams a request's output text as tokens arrive, and finds stop strings in it.

A token is not a unit of text: byte-level BPE splits one multi-byte UTF-8 character over
several tokens, and SentencePiece decodes a token differently depending on what precedes
it. So each step decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference; while the window ends in an incomplete character
(decoded as U+FFFD) nothing is emitted and the tokens wait for the rest of their bytes.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens kept so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._prefix = 0                 # window start: context for the tokens not yet emitted
        self._read = len(self._ids)      # tokens before this index are emitted
        self._held_emitted = 0           # chars of the window already emitted while it is incomplete
        self.text = ""                   # all output text emitted so far

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be "" while a character is split)."""
        self._ids.extend(new_token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        complete = final or not after.endswith(REPLACEMENT)
        # An incomplete character at the end stays back; the text before it goes out now.
        ready = after if complete else after.rstrip(REPLACEMENT)
        delta = ready[len(before) + self._held_emitted:]
        if complete:
            self._prefix, self._read, self._held_emitted = self._read, len(self._ids), 0
        else:
            self._held_emitted += len(delta)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, stops: tuple[str, ...] | list[str], start: int = 0) -> int | None:
    """Index where `text` must be cut (the earliest stop string beginning at or after
    `start`), or None. The stop string itself is not part of the output, as in OpenAI's API.
    Pass `start = len(old_text) - max(len(s) for s in stops) + 1` to search only new text."""
    start = max(start, 0)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: tuple[str, ...] | list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string; a
    streaming server holds them back until the next token decides."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
