"""`tokenmux models add | update | remove | list`: the live catalog of a running app.

    tokenmux models add NAME PATH [--slo-ttft S --slo-tpot S]
    tokenmux models update NAME PATH
    tokenmux models remove NAME [--drain S]
    tokenmux models list [--json]

With `--url` (the app's HTTP edge) the command speaks to its admin routes
(deploy/openai_api/admin.py) with `--api-key` / $TOKENMUX_API_KEY; without, it joins the Ray
cluster at `--address` (default: $RAY_ADDRESS, else the one on this machine) and asks the
app's cluster deployment directly. Both reach the same LiveCatalog. A refusal prints one line
naming the field and exits 2; success prints the entry (or the catalog) as JSON or a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

API_KEY_ENV = "TOKENMUX_API_KEY"
HTTP_TIMEOUT_S = 3600.0   # a removal waits for its drain


class CatalogRefused(Exception):
    def __init__(self, status: int, message: str, field: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


def configure_models(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="{add,update,remove,list}", required=True)
    add = sub.add_parser("add", help="serve a new model (its checkpoint is checked first)")
    add.add_argument("name")
    add.add_argument("path", help="local checkpoint directory (on every node)")
    add.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds (default: the app's)")
    add.add_argument("--slo-tpot", type=float, help="TPOT SLO in seconds (default: the app's)")
    add.add_argument("--tensor-parallel", type=int, default=1,
                     help="devices of one node the model is split over (default 1)")
    update = sub.add_parser("update", help="switch a model to new weights with no gap")
    update.add_argument("name")
    update.add_argument("path")
    remove = sub.add_parser("remove", help="stop serving a model; its in-flight requests finish first")
    remove.add_argument("name")
    remove.add_argument("--drain", type=float, help="cut requests still in flight after this many seconds")
    listing = sub.add_parser("list", help="the catalog: models, versions, retiring versions, recent changes")
    listing.add_argument("--json", action="store_true")
    for p in (add, update, remove, listing):
        p.add_argument("--url", help="the app's HTTP edge, e.g. http://127.0.0.1:8000 (default: through Ray)")
        p.add_argument("--api-key", help=f"with --url (default: ${API_KEY_ENV})")
        p.add_argument("--address", help="Ray cluster without --url (default: $RAY_ADDRESS, else auto)")
        p.add_argument("--app", default="tokenmux", help="Serve application name (default tokenmux)")
        p.set_defaults(run=run_models)


def run_models(ns: argparse.Namespace) -> int:
    backend = HTTPCatalog(ns.url, ns.api_key or os.environ.get(API_KEY_ENV)) if ns.url else RayCatalog(ns)
    try:
        if ns.models_command == "list":
            catalog = backend.catalog()
            print(json.dumps(catalog, indent=2) if ns.json else format_catalog(catalog))
            return 0
        if ns.models_command == "add":
            result = backend.change("add", name=ns.name, path=ns.path, ttft_s=ns.slo_ttft, tbt_s=ns.slo_tpot,
                                    tensor_parallel=ns.tensor_parallel)
        elif ns.models_command == "update":
            result = backend.change("update", name=ns.name, path=ns.path)
        else:
            result = backend.change("remove", name=ns.name, drain_s=ns.drain)
    except CatalogRefused as e:
        field = f" ({e.field})" if e.field else ""
        print(f"tokenmux: error{field}: {e} [{e.status}]", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def format_catalog(catalog: dict) -> str:
    lines = [f"{'MODEL':<28} {'VERSION':<24} PATH"]
    for name, e in sorted(catalog.get("models", {}).items()):
        lines.append(f"{name:<28} {e['fingerprint']:<24} {e['path']}")
    for key, path in sorted(catalog.get("retiring", {}).items()):
        lines.append(f"{key:<28} {'(retiring)':<24} {path}")
    return "\n".join(lines)


class HTTPCatalog:
    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def catalog(self) -> dict:
        return self._answer(self._request("GET", "/admin/models"))

    def change(self, op: str, **kwargs) -> dict:
        from urllib.parse import quote

        if op == "add":
            body = {"name": kwargs["name"], "path": kwargs["path"]}
            body.update({k: v for k, v in (("slo_ttft_s", kwargs["ttft_s"]), ("slo_tpot_s", kwargs["tbt_s"]),
                                           ("tensor_parallel", kwargs.get("tensor_parallel")))
                         if v is not None})
            return self._answer(self._request("POST", "/admin/models", json=body))
        path = f"/admin/models/{quote(kwargs['name'], safe='')}"
        if op == "update":
            return self._answer(self._request("PUT", path, json={"path": kwargs["path"]}))
        params = {"drain_s": kwargs["drain_s"]} if kwargs.get("drain_s") is not None else {}
        return self._answer(self._request("DELETE", path, params=params))

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        return httpx.request(method, self.url + path, headers=self.headers, timeout=HTTP_TIMEOUT_S, **kwargs)

    @staticmethod
    def _answer(response) -> dict:
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise CatalogRefused(response.status_code, error["message"], error.get("param"))
            except (ValueError, KeyError, TypeError):
                raise CatalogRefused(response.status_code, response.text[:200], None) from None
        return response.json()


class RayCatalog:
    def __init__(self, ns: argparse.Namespace) -> None:
        from deploy.cli.commands import _join

        _join(ns.address, bool(getattr(ns, "verbose", False)))
        from deploy.app_handles import cluster_handle

        self.handle = cluster_handle(ns.app)

    def catalog(self) -> dict:
        return self.handle.catalog.remote().result(timeout_s=60)

    def change(self, op: str, **kwargs) -> dict:
        result = self.handle.change_catalog.remote(op, kwargs).result(timeout_s=HTTP_TIMEOUT_S)
        error = result.get("error")
        if error:
            raise CatalogRefused(error["status"], error["message"], error.get("field"))
        return result
