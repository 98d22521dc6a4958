"""The protocol the ingress speaks to the serving cluster.

The ingress never sees workers or the router: it admits and tokenizes, hands a
`GenerateRequest` and its admission `Ticket` to an `EngineClient`, and turns the
`OutputFrame`s that come back (several tokens each, `text` = detokenized delta, the last one
has `finish_reason`) into OpenAI responses.
The real client (router + workers) is plugged in by the Serve app
(`deploy/serve_app/cluster_engine.py`); tests plug in fakes (`tests/fakes.py`).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, runtime_checkable

from deploy.openai_api.admission import Ticket
from scheduler.messages import GenerateRequest, OutputFrame

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """A model the edge serves, as requests are checked against it (its size and step costs,
    for placement, are scheduler/placement.py's ModelInfo)."""

    name: str  # what clients put in "model"
    path: str  # local checkpoint directory (holds the tokenizer)
    max_context: int  # prompt + completion tokens must fit

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ServedModel.name must be non-empty")
        if not self.path:
            raise ValueError(f"ServedModel.path must be non-empty (model {self.name!r})")
        if not isinstance(self.max_context, int) or self.max_context <= 0:
            raise ValueError(f"ServedModel.max_context must be a positive integer, got {self.max_context!r}")


class EngineStream(Protocol):
    """One request's frames, as an engine gives them: iterate for the frames (the last has a
    finish_reason), `aclose()` to stop the request (whether or not it was iterated)."""

    def __aiter__(self) -> AsyncIterator[OutputFrame]: ...

    async def __anext__(self) -> OutputFrame: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """What the ingress asks of the engine behind it. `generate`, `models` and `tokenizer` every
    engine has; `start_rate` and `servable_models` are capabilities an engine may lack (the
    defaults say so): an implementation subclasses EngineClient and overrides what it knows."""

    def generate(self, req: GenerateRequest, ticket: Ticket | None = None) -> EngineStream:
        """Stream the request's output. The engine holds `ticket` (the request's place at the edge)
        from the call on: `first_token()` at its first frame, `release()` exactly once when the
        stream ends or is closed, iterated or not. Errors should arrive as a frame with
        finish_reason="error"; the ingress also copes with an exception raised mid-stream. The
        one way to stop a request is to close its stream before the last frame: the engine
        then aborts it."""
        ...

    def models(self) -> list[ServedModel]:
        """The models served now. Called from worker threads too: must be thread-safe."""
        ...

    def tokenizer(self, model: str) -> Any:
        """The model's Hugging Face tokenizer (see `TokenizerCache`); called off the event
        loop, in a worker thread, since the first call may load it from disk."""
        ...

    def start_rate(self, model: str) -> float | None:
        """Requests of `model` the engine starts per second when they queue, at the speed it
        knows (admission's `engine_rate`); never waits. Default: None, not known."""
        return None

    async def servable_models(self) -> list[str]:
        """The served models some worker can take now (/health: none is a 503). Default: all
        of them (an engine with no cluster behind it)."""
        return [m.name for m in self.models()]


class TokenizerCache:
    """Loads each model's tokenizer once (AutoTokenizer from its local path) and keeps it."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def loaded(self, model: str) -> Any | None:
        """The tokenizer if it is loaded already (never blocks on a load)."""
        return self._tokenizers.get(model)

    def get(self, model: str, path: str) -> Any:
        with self._lock:
            tok = self._tokenizers.get(model)
            if tok is None:
                from transformers import AutoTokenizer

                logger.info("loading tokenizer of %s from %s", model, path)
                tok = AutoTokenizer.from_pretrained(path)
                self._tokenizers[model] = tok
            return tok
