"""`tokenmux bench colocate`, small: agents finish their conversations in every arrangement."""
from __future__ import annotations

import json

import pytest

from load_tests.bench.agents import Agent, AgentSpec, run_agents


def test_an_agent_conversation_grows_and_thinks(zoo_model):
    import torch

    from load_tests.bench.common import bench_host_cache, engine_for

    specs = [AgentSpec(model=f"m{i}", seed=i, turns=3, system_tokens=8, user_tokens=4, new_tokens=5, think_s=0.05)
             for i in range(2)]
    with bench_host_cache() as cache:
        engine = engine_for({s.model: zoo_model("llama-tiny-a") for s in specs}, num_slots=2, tokens_per_model=64,
                            device=torch.device("cpu"), dtype=None, host_cache=cache)
        agents = [Agent(s) for s in specs]
        run_agents(engine, agents)
    for agent in agents:
        s = agent.summary()
        assert s["tokens"] == 3 * 5 and len(s["ttft_s"]) == 3 and len(s["tbt_s"]) == 3 * 4
        assert len(agent.context) == 8 + 3 * (4 + 5)           # the whole conversation is the next prompt
        gaps = [b.arrival - a.token_times[-1] for a, b in zip(agent.turns, agent.turns[1:])]
        assert all(g >= 0.05 for g in gaps)                    # it thought before each next turn


def test_bad_options_are_named():
    from load_tests.bench.colocate import _counts

    with pytest.raises(ValueError, match="--agents"):
        _counts("2,x")
    with pytest.raises(ValueError, match=">= 1"):
        _counts("0,2")
    with pytest.raises(ValueError):
        AgentSpec(model="m", seed=0, think_s=-1)


@pytest.mark.slow
def test_colocate_runs_every_arrangement(tmp_path):
    from deploy.cli.main import main

    out = tmp_path / "colocate.json"
    with pytest.raises(SystemExit) as done:
        main(["bench", "colocate", "--agents", "2", "--model", "llama-tiny-a", "--turns", "2", "--new-tokens", "4",
              "--repeats", "1", "--think-s", "0.01", "--threads", "1", "--json", str(out),
              "--plot", str(tmp_path / "c.png")])
    assert done.value.code == 0
    r = json.loads(out.read_text())
    row = r["summary"]["2"]
    assert set(row) >= {"time-sliced", "tokenmux", "tps_ratio", "tbt_p99_ratio", "memory_ratio"}
    assert r["runs"]["2"]["time-sliced"][0]["processes"] == 2 and r["runs"]["2"]["tokenmux"][0]["processes"] == 1
    for arrangement in ("time-sliced", "tokenmux"):
        assert r["runs"]["2"][arrangement][0]["num_tokens"] == 2 * 2 * 4
    assert r["runs"]["1"]["alone"][0]["num_tokens"] == 2 * 4
    assert (tmp_path / "c.png").stat().st_size > 1000
