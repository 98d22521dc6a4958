"""Multi-node on one machine: `ray.cluster_utils.Cluster` with 2 nodes x 2 virtual GPUs,
run in a subprocess (tests/multinode_scenarios.py) because this process may already be
connected to the session Ray. One cluster, several scenarios, ~1.5 minutes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("multinode_scenarios.py")


@pytest.fixture(scope="module")
def result():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=240,
                          cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_worker_per_virtual_device_on_each_node(result):
    assert result["nodes"] == 2 and result["workers_per_node"] == [2, 2]


@pytest.mark.parametrize("scenario", ["cross_node", "same_node"])
def test_prefill_on_one_worker_decode_on_another_equals_single_worker_greedy(result, scenario):
    r = result[scenario]
    assert r["tokens"] == result["reference"]["llama-tiny-a"] and r["finish"] == "length"
    assert r["workers"][0] == r["src"] and r["workers"][-1] == r["dst"] and r["adopted"] == 1
    if scenario == "cross_node":
        assert r["src"].split("-")[0] != r["dst"].split("-")[0]
    else:
        assert r["src"].split("-")[0] == r["dst"].split("-")[0]


def test_node_added_at_runtime_gets_workers_and_takes_traffic(result):
    assert result["joined"] and len(result["new_workers"]) == 2
    assert result["new_node_served"]["ok"]
    assert set(result["new_workers"]) & (set(result["burst_workers"]) | {result["new_node_served"]["worker"]})


def test_burst_spreads_over_more_workers_and_shrinks_back(result):
    assert result["burst_failed"] == [] and result["burst_requests"] >= 64
    assert result["replicas_before"] == 1 and result["replicas_peak"] >= 2
    # the requests that started once the router had the replicas went to more than one worker
    assert result["spread_requests"] >= 16 and len(result["spread_workers"]) >= 2, result["spread_workers"]
    assert result["shrunk"] and result["replicas_after"] == 1


def test_killed_worker_leaves_routing_and_later_requests_succeed(result):
    assert result["victim_removed"] and result["after_kill_ok"] == [True, True, True]
    assert len(result["pruned"]) == 1
