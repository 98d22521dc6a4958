"""Where the live catalog (scheduler/catalog.py) is kept: Ray's GCS key-value store.

One JSON document per Ray namespace (the Serve app's job namespace holds one tokenmux
cluster), written whole on every change. The GCS outlives every actor of the cluster, so a
placement service restarted in place (Ray re-runs its constructor with the deploy config's
models) reads the catalog back instead of those models, and a replaced worker is given
the models the catalog places. Any process connected to the Ray cluster can read it.
"""
from __future__ import annotations

import json

from scheduler.catalog import ModelCatalog

KEY = b"tokenmux-catalog"
KV_NAMESPACE_PREFIX = "tokenmux:"


class CatalogStore:
    def __init__(self, namespace: str | None = None) -> None:
        """namespace: the Ray namespace of the cluster (None: this process's)."""
        import ray

        if not ray.is_initialized():
            raise ValueError("the catalog store needs a connected Ray")
        self.namespace = namespace if namespace is not None else ray.get_runtime_context().namespace

    def load(self) -> ModelCatalog | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(KEY, namespace=self._kv_namespace())
        return None if raw is None else ModelCatalog.from_dict(json.loads(raw))

    def save(self, catalog: ModelCatalog) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(KEY, json.dumps(catalog.to_dict()).encode(), overwrite=True,
                                     namespace=self._kv_namespace())

    def clear(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(KEY, namespace=self._kv_namespace())

    def _kv_namespace(self) -> str:
        return KV_NAMESPACE_PREFIX + self.namespace
