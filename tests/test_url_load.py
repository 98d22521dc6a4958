"""`tokenmux loadtest --url`: a running OpenAI-compatible server driven with a trace.

Against a minimal fake server this test starts (it streams max_tokens tokens, the first
FIRST_S after the request and then one every GAP_S), the recorded times must be what the
fake produced; against tokenmux's own server (run_local, a tiny zoo model) every request
must come back whole and be scored per model. A SIGINT ends a run early and still writes
what it measured. Loopback addresses only.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request   # at the top: the routes' annotations are resolved from here
from fastapi.responses import JSONResponse, StreamingResponse

from deploy.cli.main import build_parser
from load_tests.url_load import run_url as run
from polling import wait_until

FIRST_S = 0.10   # the fake's first token comes this long after the request
GAP_S = 0.05     # then one token every GAP_S
REPO = Path(__file__).resolve().parent.parent


def _fake_app(seen: dict):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-a"}, {"id": "fake-b"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        rid = req.headers.get("x-request-id", "?")
        seen[rid] = body
        if body["model"] not in ("fake-a", "fake-b"):
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)

        async def events():
            await asyncio.sleep(FIRST_S)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(GAP_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def fake_server():
    """The fake on 127.0.0.1 in a thread; yields (base URL, {request id: body})."""
    import uvicorn

    seen: dict = {}
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fake_app(seen), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout_s=20, what="the fake server to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _args(url: str, out: Path, *extra: str) -> list[str]:
    return ["loadtest", "--url", url, "--slo-ttft", "1.0", "--slo-tbt", "0.2", "--max-output", "6",
            "--max-input", "16", "--lengths", "lognormal", "--request-timeout", "20",
            "--json", str(out / "server.json"), "--plots", str(out / "plots"), *extra]


def test_url_run_records_the_times_the_fake_server_produced(tmp_path):
    from load_tests.records import read_records

    with fake_server() as (url, seen):
        args = build_parser().parse_args(_args(url, tmp_path, "--rates", "4,8", "--seeds", "0,1",
                                               "--sustain-s", "1.5", "--sustain-requests", "4",
                                               "--warmup-s", "0.5"))
        assert run(args) == 0
    data = json.loads((tmp_path / "server.json").read_text())
    assert list(data["contenders"]) == ["server"] and not data["interrupted"]
    assert set(data["models"]) == {"fake-a", "fake-b"}   # from its /v1/models
    records = read_records(data["records"])
    measured = [r for recs in records.points.values() for r in recs]
    assert len(measured) >= 2 * 2 * 4
    for r in measured:
        body = seen[r.request_id]
        assert r.ok and r.num_output_tokens == body["max_tokens"]
        assert body["stream"] is True and body["ignore_eos"] is True
        # the fake's first token comes FIRST_S after the request: the client saw it no sooner,
        # and not much later on a loopback (a shared machine adds its noise)
        assert FIRST_S - 0.01 <= r.ttft < FIRST_S + 0.5
        if len(r.token_times) > 2:
            # no token is seen before the fake sends it; a loaded host may read two at once
            gaps = r.tbts
            assert sum(gaps) >= len(gaps) * GAP_S - 0.01 and GAP_S * 0.8 <= statistics.median(gaps) < GAP_S + 0.1
    for rate, point in data["contenders"]["server"]["points"].items():
        assert point["num_seeds"] == 2 and set(point["per_seed"]) == {"0", "1"}
        assert point["goodput"]["mean"] == 1.0 and point["strict"]["mean"] == 1.0   # the fake is well within SLO
        # held or not is the trace's bursts over so short a window (tests/test_sustained.py pins it)
        assert isinstance(point["held"], bool) and all("queue_end" in s for s in point["per_seed"].values())
        # scored: only the window's requests (the warm-up's are left out)
        window = [r for (c, t, rt, s), recs in ((tuple(k.__dict__.values()), v) for k, v in records.points.items())
                  if rt == float(rate) for r in recs if r.arrival >= 0.5]
        assert point["num_requests"] == len(window)
    assert set(data["per_model"]["4.0"]) <= {"fake-a", "fake-b"}
    prov = data["provenance"]
    assert prov["command"] and prov["machine"]["cpu_count"] >= 1 and "started_at" in prov
    assert len(prov["revision"]) == 40 and isinstance(prov["dirty"], bool)
    report = (tmp_path / "plots" / "report.md").read_text()
    assert "goodput" in report and "strict" in report and "held " in report and "fake-a" in report
    assert (tmp_path / "plots" / "attainment_vs_rate.png").read_bytes().startswith(b"\x89PNG")


def test_sigint_stops_the_run_and_keeps_what_it_measured(tmp_path):
    with fake_server() as (url, seen):
        cmd = [sys.executable, "-m", "deploy.cli.main", *_args(url, tmp_path, "--rates", "2", "--seeds", "0",
                                                              "--sustain-s", "600", "--warmup-s", "0")]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            wait_until(lambda: len(seen) >= 6 or proc.poll() is not None, timeout_s=60, what="requests to arrive")
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            proc.send_signal(signal.SIGINT)
            started = time.monotonic()
            code = proc.wait(timeout=60)
            stopped_in = time.monotonic() - started
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 130 and stopped_in < 20   # not the 600 s the point would have offered
    data = json.loads((tmp_path / "server.json").read_text())
    assert data["interrupted"] is True
    point = data["contenders"]["server"]["points"]["2.0"]
    assert point["num_requests"] >= 3   # six sent (two of them the warm-up)
    assert "Interrupted" in (tmp_path / "plots" / "report.md").read_text()


def test_url_run_against_tokenmux_own_server(ray_session, tmp_path):
    from deploy.local import run_local
    from load_tests.records import read_records
    from net import free_port

    app_args = {"devices_per_node": 1, "threads_per_worker": 1, "budget_bytes": 64 << 20, "kv_fraction": 0.25,
                "host_kv_gb": 0.01, "num_slots": 1, "max_tokens_cap": 2000}
    with run_local({"tiny-a": "zoo:llama-tiny-a"}, port=free_port(), app_name="url-loadtest", num_devices=1,
                   **app_args) as url:
        args = build_parser().parse_args(_args(url, tmp_path, "--rates", "2", "--seeds", "0", "--sustain-s", "2",
                                               "--sustain-requests", "3", "--warmup-s", "0.5",
                                               "--slo-ttft", "10", "--slo-tbt", "2"))
        assert run(args) == 0
    data = json.loads((tmp_path / "server.json").read_text())
    assert data["models"] == ["tiny-a"]
    records = [r for recs in read_records(data["records"]).points.values() for r in recs]
    assert records and all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert all(1 <= r.num_output_tokens <= 6 for r in records)
    assert data["per_model"]["2.0"]["tiny-a"]["num_requests"] >= 1
