"""CatalogEngineClient: the edge's view of the live catalog, in front of the cluster client.

    CatalogEngineClient(ClusterEngineClient(router, ..., meter=RequestMeter()))

Clients name a model; the catalog (scheduler/catalog.py) says which version serves that name
now. `generate` decides the version once, when the request reaches the cluster: the request
goes to that version's serving key (`name` or `name@vN`) and every frame names the version
(`OutputFrame.model_version`, the response's `system_fingerprint`), so a request admitted
before an update finishes on the old version and says so. A removed name is unknown at once
(`models()`: the ingress answers 404). The catalog is read from the GCS (CatalogStore) every
REFRESH_S in the background, and at once by `refresh()` after a change made through this edge.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable

from deploy.openai_api.admission import Ticket
from deploy.openai_api.engine_protocol import EngineStream, ServedModel, TokenizerCache
from scheduler.catalog import CatalogEntry, ModelCatalog
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame

logger = logging.getLogger(__name__)

REFRESH_S = 1.0


class CatalogEngineClient:
    def __init__(self, inner: Any, catalog: ModelCatalog, load: Callable[[], ModelCatalog | None] | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        """inner: the cluster client (ClusterEngineClient: `set_models`, `generate`, `start_rate`).
        load(): the stored catalog (None: keep the one given)."""
        self.inner = inner
        self._load = load
        self._refresh_s = refresh_s
        self._contexts: dict[tuple[str, str], int] = {}   # (key, path) -> max context, read once
        self._tokenizers = TokenizerCache()
        self._catalog = ModelCatalog()
        self._served: dict[str, ServedModel] = {}
        self._refresher: asyncio.Task | None = None
        self.apply(catalog)

    def __getattr__(self, name: str):   # the rest of the wrapped client (read_workers, num_resumed, ...)
        return getattr(self.inner, name)

    # ---- the catalog -------------------------------------------------------------------------

    def apply(self, catalog: ModelCatalog) -> None:
        """Serve `catalog` from now on (a newer revision than the one held, or the first)."""
        if catalog.revision < self._catalog.revision:
            return
        placed = catalog.placed()
        keyed = [ServedModel(key, path, self._context(key, path)) for key, path in placed.items()]
        self.inner.set_models(keyed)   # the cluster client knows every placed key (old versions drain)
        self._served = {name: ServedModel(name, e.path, self._context(e.key, e.path))
                        for name, e in catalog.entries.items()}
        self._catalog = catalog

    async def refresh(self) -> None:
        if self._load is not None:
            catalog = await asyncio.to_thread(self._load)
            if catalog is not None:
                self.apply(catalog)

    def start_refreshing(self) -> None:
        if self._refresher is None and self._load is not None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception as exc:   # the GCS is unreachable for a moment: keep the catalog held
                logger.info("reading the catalog failed: %s", exc)

    def entry(self, name: str) -> CatalogEntry | None:
        return self._catalog.entries.get(name)

    # ---- EngineClient --------------------------------------------------------------------------

    def models(self) -> list[ServedModel]:
        return list(self._served.values())

    def tokenizer(self, model: str) -> Any:
        entry = self.entry(model)
        if entry is None:
            raise ValueError(f"unknown model {model!r}; served: {sorted(self._served)}")
        return self._tokenizers.get(entry.fingerprint, entry.path)

    def start_rate(self, model: str) -> float | None:
        entry = self.entry(model)
        return None if entry is None else self.inner.start_rate(entry.key)

    async def servable_models(self, timeout_s: float = 5.0) -> list[str]:
        keys = set(await self.inner.servable_models(timeout_s))
        return sorted(name for name, e in self._catalog.entries.items() if e.key in keys)

    def generate(self, req: GenerateRequest, ticket: Ticket | None = None) -> EngineStream:
        entry = self.entry(req.model)   # the version is chosen here, once
        if entry is None:
            return _RemovedStream(OutputFrame(req.request_id, finish_reason=FINISH_ERROR,
                                              num_prompt_tokens=len(req.prompt_token_ids),
                                              error=f"model {req.model!r} was removed from the catalog"), ticket)
        return _VersionedStream(self.inner.generate(dataclasses.replace(req, model=entry.key), ticket),
                                entry.fingerprint)

    def _context(self, key: str, path: str) -> int:
        if (key, path) not in self._contexts:
            from actors.model_spec import ModelSpec

            self._contexts[(key, path)] = ModelSpec.from_dir(path).max_position_embeddings
        return self._contexts[(key, path)]


class _VersionedStream:
    """The cluster client's stream of one request, each frame naming the version serving it."""

    def __init__(self, inner: EngineStream, version: str) -> None:
        self._inner = inner
        self._version = version

    def __aiter__(self) -> "_VersionedStream":
        return self

    async def __anext__(self) -> OutputFrame:
        return dataclasses.replace(await self._inner.__anext__(), model_version=self._version)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RemovedStream:
    """A request for a name removed since admission: its one error frame; the ticket is released
    once, when the frame has gone out or the stream is closed."""

    def __init__(self, frame: OutputFrame, ticket: Ticket | None) -> None:
        self._frame: OutputFrame | None = frame
        self._ticket = ticket

    def __aiter__(self) -> "_RemovedStream":
        return self

    async def __anext__(self) -> OutputFrame:
        frame, self._frame = self._frame, None
        if frame is None:
            await self.aclose()
            raise StopAsyncIteration
        return frame

    async def aclose(self) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ticket.release()
