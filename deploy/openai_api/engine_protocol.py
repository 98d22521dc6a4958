"""The protocol the ingress speaks to the serving cluster.

The ingress never sees workers or the router: it tokenizes, hands a `GenerateRequest`
to an `EngineClient`, and turns the `OutputFrame`s that come back (several tokens each,
`text` = detokenized delta, the last one has `finish_reason`) into OpenAI responses.
The real client (router + workers) is plugged in by the Serve app
(`deploy/serve_app/cluster_engine.py`); tests plug in fakes (`tests/fakes.py`).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Protocol, runtime_checkable

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


@runtime_checkable
class EngineClient(Protocol):
    def generate(self, req: GenerateRequest) -> AsyncGenerator[OutputFrame, None]:
        """Stream the request's output; an `async def` with `yield` satisfies this.
        Errors should arrive as a frame with finish_reason="error"; the ingress also
        copes with an exception raised mid-stream. The one way to stop a request is to close
        (or cancel) its stream before the last frame: the engine then aborts it."""
        ...

    def models(self) -> list[ServedModel]:
        """The models served now. Called from worker threads too: must be thread-safe."""
        ...

    def tokenizer(self, model: str) -> Any:
        """The model's Hugging Face tokenizer (see `TokenizerCache`); called off the event
        loop, in a worker thread, since the first call may load it from disk."""
        ...


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
