"""Metrics end to end: a short load against the served app, scraped by a real Prometheus.

One app for the module (run_local, the in-process `tokenmux serve`, on the session Ray):
4 tiny zoo models on 2 virtual devices whose budgets hold one model and a prefetch slot
each (so workers switch, swap and prefetch), plus one model too big for any slot (the
router has no worker for it). The load is closed-loop and heavy enough for placement to
split the workers into prefill and decode (so KV handoffs happen); it runs until Prometheus
has every series the tests look for (at most LOAD_S). Prometheus is
configured by `tokenmux metrics prometheus-config` over Ray's service-discovery file,
exactly as a user runs it, and scrapes every second.

Then: every metric of the catalogue that a CPU host can have is in Prometheus, and every
panel's PromQL of every dashboard (deploy/dashboards/*.json) returns data.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from actors.metrics import CATALOG, prometheus_name
from tests.prometheus_server import PROMETHEUS_MISSING, PrometheusServer, free_port, prometheus_binary

MiB = 1 << 20
MODELS = {"llama-a": "zoo:llama-tiny-a", "qwen-b": "zoo:qwen2-tiny-b", "llama-c": "zoo:llama-tiny-c",
          "mistral-d": "zoo:mistral-tiny-a", "too-big": "zoo:llama-10m"}
SERVED = ("llama-a", "qwen-b", "llama-c", "mistral-d")
ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2, "slo": {"ttft_s": 5.0, "tbt_s": 0.5}}
LOAD_S = 25.0   # at most: the load ends as soon as Prometheus has every series the tests look for
CHECK_S = 2.0
CONCURRENCY = 10
NVML_ONLY = {"tokenmux_device_power_watts", "tokenmux_device_temperature_celsius"}
DASHBOARDS = Path(__file__).resolve().parents[1] / "deploy" / "dashboards"


# Other tests of the session share this Ray (and so its metrics agent): where a metric has a
# model label, only the models no other test serves count as evidence of this app's load.
OWN_MODELS = 'model=~"llama-c|mistral-d|too-big|all"'


def _series(name: str) -> str:
    spec = CATALOG[name]
    series = prometheus_name(name) + ("_count" if spec.kind == "histogram" else "")
    return series + ("{" + OWN_MODELS + "}" if "model" in spec.labels else "")


async def _load(url: str, seconds: float, seen=lambda: False) -> dict:
    """Closed-loop clients over the served models, and one request no worker can take; for
    `seconds`, or less once `seen()` (asked every CHECK_S, off the event loop) says Prometheus
    has every piece of evidence the tests look for."""
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    enough = asyncio.Event()

    async def watch() -> None:
        while not enough.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(CHECK_S)
            if await asyncio.to_thread(seen):
                enough.set()

    async def client(i: int, http: httpx.AsyncClient) -> None:
        k = i
        while time.monotonic() < deadline and not enough.is_set():
            body = {"model": SERVED[k % len(SERVED)], "prompt": f"Request {k} of client {i}", "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            k += 1
            r = await http.post(f"{url}/v1/completions", json=body, timeout=120)
            outcomes[str(r.status_code)] = outcomes.get(str(r.status_code), 0) + 1

    async with httpx.AsyncClient() as http:
        r = await http.post(f"{url}/v1/completions", json={"model": "too-big", "prompt": "x", "max_tokens": 2},
                            timeout=60)
        outcomes["too-big"] = r.status_code
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(i, http) for i in range(CONCURRENCY)))
        watcher.cancel()
    return outcomes


@pytest.fixture(scope="module")
def observed(ray_session, tmp_path_factory):
    if prometheus_binary() is None:
        pytest.skip(PROMETHEUS_MISSING)
    from deploy.cli.main import main
    from deploy.local import run_local

    tmp = tmp_path_factory.mktemp("prometheus")
    with run_local(MODELS, port=free_port(), **ARGS) as url:
        with pytest.raises(SystemExit) as done:
            main(["metrics", "prometheus-config", "--out", str(tmp / "prometheus.yml"), "--scrape-interval", "1",
                  "--loopback"])
        assert done.value.code == 0
        server = PrometheusServer(tmp / "prometheus.yml", tmp)
        evidence = _evidence()
        try:
            outcomes = asyncio.run(_load(url, LOAD_S, lambda: all(server.query(e) for e in evidence)))
            yield server, outcomes
        finally:
            server.stop()


# Label evidence test_metrics_carry_model_and_worker_labels looks for (placement split the
# workers under the load, KV moved between them, the too-big model found no worker).
LABELLED = ('ray_tokenmux_router_no_worker_total{model="too-big"}',
            'ray_tokenmux_placement_changes_total{change=~"role_.*"}',
            'ray_tokenmux_kv_handoffs_total{outcome="handed_off", model=~"llama-c|mistral-d"} > 0',
            'ray_tokenmux_kv_handoff_bytes_total{model=~"llama-c|mistral-d"} > 0')


def _evidence() -> list[str]:
    """Every query the tests below need data for: the catalogue, the labelled series, every panel."""
    from deploy.dashboards.generate import find_panel

    panels = [e for _, t, e in _dashboard_queries() if not find_panel(t).nvml_only]
    return [_series(n) for n in CATALOG if n not in NVML_ONLY] + list(LABELLED) + panels


def _targets_up(server: PrometheusServer, timeout_s: float = 20.0) -> list[dict]:
    """Prometheus's targets once every one is up, or as they are after timeout_s: a scrape
    every second with a 1 s timeout can miss once on a loaded host (then it reads "down"
    until the next one); a target never reached stays down and fails the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        targets = server.targets()
        if (targets and all(t["health"] == "up" for t in targets)) or time.monotonic() > deadline:
            return targets
        time.sleep(0.5)


def _wait_for(server: PrometheusServer, exprs: list[str], timeout_s: float = 45.0) -> list[str]:
    """The expressions still without data after timeout_s (Ray exports every second, Prometheus scrapes every second)."""
    deadline = time.monotonic() + timeout_s
    missing = list(exprs)
    while missing and time.monotonic() < deadline:
        missing = [e for e in missing if not server.query(e)]
        if missing:
            time.sleep(1.0)
    return missing


def test_prometheus_scrapes_ray_through_the_generated_config(observed):
    server, outcomes = observed
    targets = _targets_up(server)
    assert targets and all(t["health"] == "up" for t in targets), targets
    assert all(t["labels"]["instance"].startswith("127.0.0.1:") for t in targets)   # loopback only
    assert outcomes.get("200", 0) >= 20, outcomes
    assert outcomes["too-big"] >= 500   # no worker holds it: the request fails, and says so


def test_every_metric_is_in_prometheus(observed):
    server, _ = observed
    expected = [_series(n) for n in CATALOG if n not in NVML_ONLY]
    missing = _wait_for(server, expected)
    assert missing == [], f"no data in Prometheus for {missing}"


def test_metrics_carry_model_and_worker_labels(observed):
    server, _ = observed
    rows = server.query("sum by (model, worker) (ray_tokenmux_generation_tokens_total)")
    assert {r["metric"]["model"] for r in rows} >= set(SERVED)
    assert len({r["metric"]["worker"] for r in rows if r["metric"]["model"] in ("llama-c", "mistral-d")}) == 2
    reasons = server.query('sum by (finished_reason) (ray_tokenmux_request_success_total{model="llama-c"})')
    assert {r["metric"]["finished_reason"] for r in reasons} == {"length"}
    assert len(server.query('ray_tokenmux_device_utilization{virtual="true"}')) >= 2
    # the too-big model found no worker; placement split the workers (prefill / decode) under
    # the load, and KV moved between them
    assert _wait_for(server, list(LABELLED)) == []


def test_counters_agree_with_what_clients_got(observed):
    server, outcomes = observed
    _wait_for(server, ["ray_tokenmux_ingress_requests_total"])
    time.sleep(3)   # the last flush (1 s) and scrape (1 s)
    for model in ("llama-c", "mistral-d"):   # served by this app only (see OWN_MODELS)
        ok = sum(float(r["value"][1]) for r in
                 server.query(f'ray_tokenmux_ingress_requests_total{{outcome="ok", model="{model}"}}'))
        tokens = sum(float(r["value"][1]) for r in
                     server.query(f'ray_tokenmux_generation_tokens_total{{model="{model}"}}'))
        assert ok >= outcomes["200"] // len(SERVED) - CONCURRENCY and tokens == 12 * ok


def _dashboard_queries() -> list[tuple[str, str, str]]:
    from deploy.dashboards.generate import panel_queries

    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for title, expr in panel_queries(json.loads(path.read_text())):
            out.append((path.name, title, expr))
    return out


def test_dashboards_on_disk_are_the_generated_ones():
    from deploy.dashboards.generate import render
    from deploy.dashboards.panels import DASHBOARDS as SPECS

    for spec in SPECS:
        path = DASHBOARDS / f"{spec.uid.removeprefix('tokenmux-')}.json"
        assert path.read_text() == render(spec), f"{path} is stale: run `tokenmux dashboard build`"
    assert len(_dashboard_queries()) >= 40


def test_every_dashboard_panel_query_returns_data(observed):
    from deploy.dashboards.generate import find_panel

    server, _ = observed
    queries = [(f, t, e) for f, t, e in _dashboard_queries() if not find_panel(t).nvml_only]
    missing = _wait_for(server, [e for _, _, e in queries])
    assert missing == [], "panels without data: " + "; ".join(
        f"{f} / {t}: {e}" for f, t, e in queries if e in missing)


def test_status_watch_shows_each_worker_live(observed):
    import io

    from rich.console import Console

    from deploy.cli.status_watch import watch

    buf = io.StringIO()
    assert watch(interval_s=0.5, iterations=2, console=Console(file=buf, width=220, force_terminal=False)) == 0
    text = buf.getvalue()
    for column in ("RESIDENT", "TOKENS/S", "ALPHA", "SWAPS/S", "DEVICE MEMORY"):
        assert column in text
    assert text.count("(virtual)") >= 2 and any(m in text for m in SERVED)
