"""The real `serve deploy` flow, in a world of its own: a separate Ray head started with
`ray start --head --block` (a child process group of this test, ended with SIGTERM then
SIGKILL — never `ray stop`), `serve deploy deploy/serve_app/serve_config.yaml` (a temp copy with a
free HTTP port), HTTP queries, `tokenmux status`, `serve shutdown`, and `tokenmux
shutdown` finding nothing left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "deploy" / "serve_app" / "serve_config.yaml"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def head(zoo_model):
    """A Ray head in its own process group: (gcs address, dashboard url, temp dir)."""
    config = yaml.safe_load(CONFIG.read_text())
    for source in config["applications"][0]["args"]["models"].values():
        zoo_model(source.removeprefix("zoo:"))   # built here, so the replica only loads them
    gcs_port, dash_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="tmd", dir="/tmp")
    log = open(Path(temp_dir) / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=2", "--num-gpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
         f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
         "--object-store-memory=200000000", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{dash_port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, (Path(temp_dir) / "head.log").read_text()[-3000:]
            try:
                if httpx.get(f"{dashboard}/api/version", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            log_tail = (Path(temp_dir) / "head.log").read_text()[-3000:]
            pytest.fail(f"the Ray head's dashboard did not come up: {log_tail}")
        yield f"127.0.0.1:{gcs_port}", dashboard, temp_dir
    finally:
        _end_group(proc)
        log.close()


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the head's process group (ours alone), then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):   # `ray start --block` takes >15 s to end on TERM
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)   # let the group's other members take the signal too


def _app_status(dashboard: str) -> str:
    """The app's status as `serve status` reads it (the dashboard's REST API), without a
    `serve` process (and its ~3 s of imports) per poll."""
    try:
        resp = httpx.get(f"{dashboard}/api/serve/applications/", timeout=30)
    except httpx.HTTPError as exc:
        return f"serve status failed: {exc!r}"
    if resp.status_code != 200:
        return f"serve status failed: {resp.status_code} {resp.text[:500]}"
    app = (resp.json().get("applications") or {}).get("tokenmux") or {}
    return app.get("status", "MISSING") + " " + str(app.get("message", ""))[:2000]


def test_serve_deploy_the_config_query_and_shut_down(head, tmp_path):
    gcs, dashboard, _ = head
    config = yaml.safe_load(CONFIG.read_text())
    port = free_port()
    config["http_options"]["port"] = port
    cfg = tmp_path / "serve_config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    models = sorted(config["applications"][0]["args"]["models"])

    out = _run(BIN / "serve", "deploy", cfg, "--address", dashboard)
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 240
    status = ""
    while time.monotonic() < deadline:
        status = _app_status(dashboard)
        if status.startswith("RUNNING") or status.startswith("DEPLOY_FAILED"):
            break
        time.sleep(1)
    assert status.startswith("RUNNING"), status

    url = f"http://127.0.0.1:{port}"
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert sorted(m["id"] for m in listed["data"]) == models
    resp = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": models[0], "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4

    out = _run(BIN / "tokenmux", "status", "--address", gcs)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "placement plan" in out.stdout and all(m in out.stdout for m in models)

    out = _run(BIN / "serve", "shutdown", "-y", "--address", dashboard)
    assert out.returncode == 0, out.stderr[-2000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _app_status(dashboard).startswith("MISSING"):
        time.sleep(1)
    out = _run(BIN / "tokenmux", "shutdown", "--address", gcs)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nothing" in out.stdout, out.stdout   # the topology died with the app
