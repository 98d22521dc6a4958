"""Provision the tokenmux dashboards in a Grafana through its HTTP API (grafana-client).

    push_dashboards("http://127.0.0.1:3000", token)   # = tokenmux dashboard push --url ... --token ...

Makes the folder if it is missing (found by title), then posts each dashboard of
deploy/dashboards/*.json (freshly built from panels.py) with `overwrite: true`, so pushing
again updates in place. The `${datasource}` variable is pointed at `datasource_uid`.
Grafana's answers (uid, url, version of each dashboard) are returned.
"""
from __future__ import annotations

from deploy.dashboards.generate import build
from deploy.dashboards.panels import DASHBOARDS


def push_dashboards(url: str, token: str, folder: str = "tokenmux", datasource_uid: str = "prometheus",
                    timeout_s: float = 30.0) -> dict:
    from grafana_client import GrafanaApi

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http(s) URL of a Grafana, got {url!r}")
    if not token:
        raise ValueError("--token is empty; create a Grafana service-account token")
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    folder_uid = _ensure_folder(api, folder)
    pushed = {}
    for spec in DASHBOARDS:
        board = build(spec)
        for variable in board.get("templating", {}).get("list", []):
            if variable.get("name") == "datasource":
                variable["current"] = {"text": datasource_uid, "value": datasource_uid}
        answer = api.dashboard.update_dashboard({"dashboard": board, "folderUid": folder_uid, "overwrite": True,
                                                 "message": "tokenmux dashboard push"})
        pushed[spec.uid] = {k: answer.get(k) for k in ("uid", "url", "version", "status")}
    return {"folder": {"title": folder, "uid": folder_uid}, "dashboards": pushed}


def _ensure_folder(api, title: str) -> str:
    for existing in api.folder.get_all_folders():
        if existing.get("title") == title:
            return existing["uid"]
    return api.folder.create_folder(title)["uid"]
