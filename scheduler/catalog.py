"""The live model catalog as data: which models the cluster serves, at which version.

    ModelCatalog
        entries   public name -> CatalogEntry (path, version, SLO): what new requests reach
        retiring  serving key -> path: an old version or a removed model, placed until drained
        events    the last EVENTS_KEPT changes (add, update, remove, placement), oldest first

A model's *serving key* is what the router, placement and workers know it by: the public
name for version 1 (so a deployed config's models keep their names everywhere), `name@vN`
for later versions. An update places the new key next to the old one, then switches the
entry, so requests admitted before the switch finish on the old key while new ones reach
the new one; the old key retires once its requests are gone. Every response names the
version that served it (`CatalogEntry.fingerprint`, the OpenAI `system_fingerprint`).

The catalog is stored whole (cluster/catalog_store.py: Ray's GCS key-value store) on every
change, so a restarted placement service or router, and a replaced worker, see the same one.
Pure data, no ray: the edge and the control plane share it.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Mapping

from scheduler.tp_groups import check_tensor_parallel

VERSION_SEP = "@v"
EVENTS_KEPT = 64
CHANGE_KINDS = ("add", "update", "remove")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class CatalogError(ValueError):
    """A change the catalog refuses; `field` names what was wrong, `status` the HTTP status."""

    def __init__(self, message: str, field: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def serving_key(name: str, version: int) -> str:
    return name if version == 1 else f"{name}{VERSION_SEP}{version}"


def model_name(key: str) -> str:
    """The model a serving key serves (`name@vN` -> `name`; names never hold `@`)."""
    return key.split(VERSION_SEP, 1)[0]


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise CatalogError(f"model name must be 1-128 characters of letters, digits and . _ : / - "
                           f"(starting with a letter or digit), got {name!r}", "name")
    return name


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: str
    version: int = 1
    ttft_s: float | None = None   # the model's SLO (None: the cluster's)
    tbt_s: float | None = None
    tensor_parallel: int = 1      # devices of the model's group on one node (1: a single device)

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.path, str) or not self.path:
            raise CatalogError(f"path must be a non-empty string, got {self.path!r}", "path")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise CatalogError(f"version must be a positive int, got {self.version!r}", "version")
        for name in ("ttft_s", "tbt_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < 3600):
                raise CatalogError(f"{name} must be a number of seconds in (0, 3600), got {value!r}", name)
        try:
            check_tensor_parallel(self.tensor_parallel, model=self.name)
        except ValueError as exc:
            raise CatalogError(str(exc), "tensor_parallel") from None

    @property
    def key(self) -> str:
        return serving_key(self.name, self.version)

    @property
    def fingerprint(self) -> str:
        return f"{self.name}{VERSION_SEP}{self.version}"

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "version": self.version, "key": self.key,
                "fingerprint": self.fingerprint, "ttft_s": self.ttft_s, "tbt_s": self.tbt_s,
                "tensor_parallel": self.tensor_parallel}

    @classmethod
    def from_dict(cls, d: Mapping) -> "CatalogEntry":
        return cls(d["name"], d["path"], int(d.get("version", 1)), d.get("ttft_s"), d.get("tbt_s"),
                   int(d.get("tensor_parallel", 1)))   # a catalog stored before the field: 1


@dataclass(frozen=True)
class CatalogEvent:
    time: float
    kind: str      # add | update | remove | placed | retired | cut | failed
    model: str
    detail: str = ""

    def to_dict(self) -> dict:
        return {"time": self.time, "kind": self.kind, "model": self.model, "detail": self.detail}


@dataclass(frozen=True)
class ModelCatalog:
    entries: Mapping[str, CatalogEntry] = field(default_factory=dict)
    retiring: Mapping[str, str] = field(default_factory=dict)
    events: tuple[CatalogEvent, ...] = ()
    revision: int = 0

    @classmethod
    def of_models(cls, models: Mapping[str, str]) -> "ModelCatalog":
        """A deployed config's models, each at version 1 (deploying is adding them)."""
        catalog = cls()
        for name, path in models.items():
            catalog = catalog.with_entry(CatalogEntry(name, str(path)), "add")
        return catalog

    def placed(self) -> dict[str, str]:
        """Serving key -> checkpoint dir of every key placement keeps on workers."""
        return {**{e.key: e.path for e in self.entries.values()}, **self.retiring}

    def entry(self, name: str) -> CatalogEntry:
        if name not in self.entries:
            raise CatalogError(f"model {name!r} is not in the catalog; served: {sorted(self.entries)}", "name", 404)
        return self.entries[name]

    def with_entry(self, entry: CatalogEntry, kind: str, detail: str = "") -> "ModelCatalog":
        """`entry` serves its name from now on; an older version's key goes to `retiring`."""
        retiring = dict(self.retiring)
        old = self.entries.get(entry.name)
        if old is not None and old.key != entry.key:
            retiring[old.key] = old.path
        retiring.pop(entry.key, None)
        return self._changed({**self.entries, entry.name: entry}, retiring, kind, entry.name,
                             detail or f"{entry.fingerprint} from {entry.path}")

    def without(self, name: str) -> "ModelCatalog":
        """`name` reaches nothing new; its key retires (placed until its requests are gone)."""
        entry = self.entry(name)
        entries = {n: e for n, e in self.entries.items() if n != name}
        return self._changed(entries, {**self.retiring, entry.key: entry.path}, "remove", name, entry.fingerprint)

    def retired(self, key: str) -> "ModelCatalog":
        retiring = {k: p for k, p in self.retiring.items() if k != key}
        return self._changed(self.entries, retiring, "retired", key)

    def logged(self, kind: str, model: str, detail: str = "") -> "ModelCatalog":
        return self._changed(self.entries, self.retiring, kind, model, detail)

    def _changed(self, entries, retiring, kind: str, model: str, detail: str = "") -> "ModelCatalog":
        events = (*self.events, CatalogEvent(time.time(), kind, model, detail))[-EVENTS_KEPT:]
        return replace(self, entries=entries, retiring=retiring, events=events, revision=self.revision + 1)

    def to_dict(self) -> dict:
        return {"revision": self.revision,
                "models": {n: e.to_dict() for n, e in sorted(self.entries.items())},
                "retiring": dict(sorted(self.retiring.items())),
                "events": [e.to_dict() for e in self.events]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelCatalog":
        return cls(entries={n: CatalogEntry.from_dict(e) for n, e in d.get("models", {}).items()},
                   retiring=dict(d.get("retiring", {})),
                   events=tuple(CatalogEvent(**e) for e in d.get("events", ())),
                   revision=int(d.get("revision", 0)))
