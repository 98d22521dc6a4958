"""Streams a request's output text as tokens arrive, and finds stop strings in it.

A token is not a unit of text: byte-level BPE splits one multi-byte UTF-8 character over
several tokens, and SentencePiece decodes a token differently depending on what precedes
it. So each step decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference; while the window ends in an incomplete character
(decoded as U+FFFD) nothing is emitted and the tokens wait for the rest of their bytes.
Fast tokenizers do the same in one call: `tokenizers`' DecodeStream, primed with the
same prompt context.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens kept so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._output: list[int] = []
        self.text = ""                   # all output text emitted so far
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Fast tokenizers: the `tokenizers` library's own streaming decoder (Rust, ~1.5 us a
        # token, one call per step) does what the window below does (~20 us: two decodes).
        self._stream = _decode_stream(self._context, skip_special_tokens) if backend is not None else None
        self._backend = backend
        self._window = _Window(self) if self._stream is None else None

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be "" while a character is split)."""
        if not new_token_ids:
            return ""
        self._output.extend(new_token_ids)
        if self._window is not None:
            delta = self._window.emit(new_token_ids, final=False)
        else:
            # one token at a time: a chunk ending in a split character still yields what precedes it
            if len(new_token_ids) == 1:
                delta = self._stream.step(self._backend, new_token_ids[0]) or ""
            else:
                delta = "".join(self._stream.step(self._backend, t) or "" for t in new_token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Emit whatever is still held back (an incomplete character becomes U+FFFD)."""
        if self._window is not None:
            delta = self._window.emit([], final=True)
        else:
            full = self._decode(self._context + self._output)[len(self._decode(self._context)):]
            delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class _Window:
    """Slow tokenizers: decode a short window twice, with and without the new tokens."""

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self._ids = list(detok._context)           # context, then every output token
        self._prefix = 0                           # window start: context for the tokens not yet emitted
        self._read = len(self._ids)                # tokens before this index are emitted
        self._held_emitted = 0                     # chars of the window already emitted while incomplete

    def emit(self, new_token_ids: list[int], final: bool) -> str:
        self._ids.extend(new_token_ids)
        before = self.detok._decode(self._ids[self._prefix:self._read])
        after = self.detok._decode(self._ids[self._prefix:])
        complete = final or not after.endswith(REPLACEMENT)
        # An incomplete character at the end stays back; the text before it goes out now.
        ready = after if complete else after.rstrip(REPLACEMENT)
        delta = ready[len(before) + self._held_emitted:]
        if complete:
            self._prefix, self._read, self._held_emitted = self._read, len(self._ids), 0
        else:
            self._held_emitted += len(delta)
        return delta


def _decode_stream(context: list[int], skip_special_tokens: bool):
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):   # older tokenizers: no DecodeStream, or no prefill ids
        return None


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
