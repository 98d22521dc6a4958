"""`tokenmux dashboard push` against a local HTTP endpoint.

This endpoint is NOT a Grafana server (none can be installed here): it is a few lines of
http.server that answer the three Grafana HTTP API routes grafana-client calls for a push
(GET/POST /api/folders, POST /api/dashboards/db) in Grafana's documented shapes, and
record what arrived. The test checks what tokenmux sends: the token, the folder, every
generated dashboard with overwrite on, and the data source variable set.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.dashboards.panels import DASHBOARDS


class _NotGrafana(BaseHTTPRequestHandler):
    received: list = []
    folders: list = []

    def log_message(self, *args):
        pass

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.received.append((self.command, self.path, self.headers.get("Authorization"), body))
        return body

    def do_GET(self):
        self._record()
        if self.path.startswith("/api/folders"):
            return self._answer(200, self.folders)
        self._answer(404, {"message": "not found"})

    def do_POST(self):
        body = self._record()
        if self.path == "/api/folders":
            folder = {"uid": "f-1", "title": body["title"], "id": 1}
            self.folders.append(folder)
            return self._answer(200, folder)
        if self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            return self._answer(200, {"uid": uid, "url": f"/d/{uid}", "version": 1, "status": "success", "id": 7})
        self._answer(404, {"message": "not found"})


@pytest.fixture
def endpoint():
    _NotGrafana.received, _NotGrafana.folders = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_push_sends_every_dashboard_with_the_token(endpoint):
    from deploy.dashboards.push import push_dashboards

    out = push_dashboards(endpoint, "secret-token", folder="tokenmux", datasource_uid="prom-1")
    assert out["folder"] == {"title": "tokenmux", "uid": "f-1"}
    assert sorted(out["dashboards"]) == sorted(s.uid for s in DASHBOARDS)
    posted = [body for method, path, _, body in _NotGrafana.received if path == "/api/dashboards/db"]
    assert len(posted) == len(DASHBOARDS)
    assert all(auth == "Bearer secret-token" for _, _, auth, _ in _NotGrafana.received)
    for body in posted:
        assert body["overwrite"] is True and body["folderUid"] == "f-1"
        variable = next(v for v in body["dashboard"]["templating"]["list"] if v["name"] == "datasource")
        assert variable["current"]["value"] == "prom-1"
        assert body["dashboard"]["panels"] and all(p["targets"] for p in body["dashboard"]["panels"])


def test_push_again_reuses_the_folder(endpoint):
    from deploy.dashboards.push import push_dashboards

    push_dashboards(endpoint, "t")
    push_dashboards(endpoint, "t")
    creates = [1 for method, path, _, _ in _NotGrafana.received if method == "POST" and path == "/api/folders"]
    assert len(creates) == 1


def test_push_cli_rejects_a_bad_url(capsys):
    from deploy.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["dashboard", "push", "--url", "grafana:3000", "--token", "t"])
    assert done.value.code == 2 and "http(s) URL" in capsys.readouterr().err
