"""`tokenmux models add NAME PATH --tensor-parallel N` on a running app (issue 43 + 44): the real
Serve app on 2 virtual devices, serving one single-device zoo model; a TP-2 model added over
the admin API (`tokenmux models add --tensor-parallel 2 --url`) is placed on a group of both devices, formed by the topology, and serves exact
greedy output beside the first model. A degree larger than a node's devices, or not a power
of two, is a 4xx naming `tensor_parallel` and changes nothing."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.net import free_port
from tests.test_serve_tensor_parallel import ARGS as TP_ARGS
from tests.test_serve_tensor_parallel import PROMPTS, assert_exact, burst

APP = "tokenmux-tp-add"
ARGS = {k: v for k, v in TP_ARGS.items() if k != "tensor_parallel"}


@pytest.fixture(scope="module")
def served(ray_session, zoo_model):
    from deploy.local import run_local

    paths = {"llama": str(zoo_model("llama-tiny-a")), "big": str(zoo_model("llama-tiny-b"))}
    with run_local({"llama": paths["llama"]}, port=free_port(), app_name=APP, **ARGS) as base:
        yield base, paths


@pytest.mark.timeout(400)
def test_a_tp2_model_added_to_a_running_app_serves_exactly_on_a_group(served, capsys):
    import ray

    from deploy.app_handles import cluster_handle
    from deploy.cli.main import main

    url, paths = served
    for degree, status in ((4, 422), (3, 400)):
        r = httpx.post(f"{url}/admin/models", timeout=60,
                       json={"name": "big", "path": paths["big"], "tensor_parallel": degree})
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == "tensor_parallel", r.text
    assert "big" not in httpx.get(f"{url}/admin/models", timeout=30).json()["models"]

    with pytest.raises(SystemExit) as done:   # the CLI, over the admin API
        main(["models", "add", "big", paths["big"], "--tensor-parallel", "2", "--url", url])
    assert done.value.code == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert entry["tensor_parallel"] == 2
    assert httpx.get(f"{url}/admin/models", timeout=30).json()["models"]["big"]["tensor_parallel"] == 2

    plan = cluster_handle(APP).status.remote().result(timeout_s=60).plan
    group = plan.group_of(entry["key"])
    assert len(group) == 2 and plan.workers_for(entry["key"]) == group[:1], plan.to_dict()

    assert_exact(burst(url, [(m, p) for p in PROMPTS for m in ("big", "llama")]), paths)
    workers = cluster_handle(APP).worker_handles.remote().result()
    for w in group:   # both devices ran the group's steps (the member's, followed)
        assert any(rec.model == entry["key"] for rec in ray.get(workers[w].timeline.remote())), w


def test_zz_undeploy(served):
    from ray import serve

    from deploy.local import undeploy

    undeploy(APP)
    assert APP not in serve.status().applications
