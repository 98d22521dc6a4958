"""`tokenmux plan` with a model larger than one device: the scaled qwen2.5-72b at tensor
parallel 2, whose group counts all its devices in the GPU totals and its turns on each."""
from __future__ import annotations

import argparse
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from cluster.planner import plan_cli
from cluster.planner.devices import DEVICES
from cluster.planner.marketplace import MODEL_TYPES, PROFILES_DIR, Marketplace, parse_mix
from cluster.planner.simulator import simulate
from deploy.cli.main import main

pytestmark = pytest.mark.skipif(not PROFILES_DIR.is_dir(), reason="shared profiles not found")
MIX = "qwen2.5-72b:1,qwen2.5-7b:2"   # of three models, the second most requested is the 72B


def _trace(path: Path, n: int = 45, seed: int = 3) -> Path:
    """A light Aegaeon-format trace of three models, about one request a second."""
    rng = random.Random(seed)
    rows, t = ["Request Time,Model Name,Input Length,Output Length"], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        rows.append(f"00:{int(t // 60):02d}:{t % 60:06.3f},{rng.choice(['a', 'b', 'c'])},"
                    f"{rng.randint(100, 600)},{rng.randint(20, 120)}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _spec(trace: Path, *extra: str):
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.build_spec(parser.parse_args(["--trace", str(trace), "--gpu", "H20", "--slots", "1",
                                                  "--model-mix", MIX, *extra]))


def test_the_72b_needs_two_devices_and_its_costs_are_scaled_and_labelled_so():
    big, base = MODEL_TYPES["qwen2.5-72b"], MODEL_TYPES["qwen2.5-7b"]
    for gpu in ("H800", "H20"):
        memory = DEVICES[gpu].memory_bytes
        assert big.weight_bytes > memory > big.device_weight_bytes   # one device cannot hold it; half fits
        fit, measured = big.fit(PROFILES_DIR, gpu), base.fit(PROFILES_DIR, gpu)
        assert "scaled" in fit.source and "all-reduce" in fit.source
        # each device reads 4.8x the 7B's weights a step, so a decode step costs several times the 7B's
        assert 3 * measured.decode_s(1, 500) < fit.decode_s(1, 500) < 10 * measured.decode_s(1, 500)
    slow_link = Marketplace.build(["m"], parse_mix("qwen2.5-72b"),
                                  DEVICES["H800"].__class__(**{**DEVICES["H800"].to_dict(), "d2d_bytes_per_s": 1e9}))
    fast_link = Marketplace.build(["m"], parse_mix("qwen2.5-72b"), "H800")
    assert slow_link.fits["m"].decode_s(32, 32_000) > fast_link.fits["m"].decode_s(32, 32_000)   # all-reduce bytes
    assert big.to_dict()["costs"] == "scaled from qwen2.5-7b" and base.to_dict()["costs"] == "measured"


def test_plan_counts_every_device_of_the_72b_group(tmp_path, capsys):
    """Dedicated gives each model its own devices: 2 for the 72B's group + 1 + 1 = 4, found
    as the first count searched. Token-level never answers, nor searches, fewer devices than
    the group has; its answer is at most dedicated's."""
    trace = _trace(tmp_path / "trace.csv")
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as ended:
        main(["plan", "--trace", str(trace), "--gpu", "H20", "--slots", "1", "--model-mix", MIX,
              "--policies", "token,dedicated", "--no-progress", "--json", str(out)])
    assert ended.value.code == 0
    printed = capsys.readouterr().out
    assert "qwen2.5-72b: step costs scaled from qwen2.5-7b, not measured, tensor_parallel 2" in printed
    result = json.loads(out.read_text())
    assert result["workload"]["model_types"]["qwen2.5-72b"]["costs"] == "scaled from qwen2.5-7b"
    dedicated, token = result["policies"]["dedicated"], result["policies"]["token"]
    assert dedicated["gpus"] == 4 and min(int(n) for n in dedicated["curve"]) == 4
    assert token["gpus"] is not None and 2 <= token["gpus"] <= dedicated["gpus"]
    assert min(int(n) for n in token["curve"]) >= 2


def test_one_device_serves_none_of_the_72b_requests(tmp_path):
    spec, _ = _spec(_trace(tmp_path / "trace.csv"))
    big = next(m for m, t in spec.market.types.items() if t.name == "qwen2.5-72b")
    result = simulate(spec.workload, spec.market, spec.fleet("token", 1), spec.demand)
    failed = Counter(r.model for r in result.records if r.error)
    assert failed[big] == sum(r.model == big for r in spec.workload) > 0
    assert not any(failed[m] for m in spec.market.types if m != big)


def test_a_groups_turns_hold_every_device_it_occupies(tmp_path):
    """On two devices shared by the 72B's group and two 7B models: the 72B's turns appear on
    both, and no device runs two turns at once (a member waits out the group's step)."""
    spec, _ = _spec(_trace(tmp_path / "trace.csv"))
    big = next(m for m, t in spec.market.types.items() if t.name == "qwen2.5-72b")
    result = simulate(spec.workload, spec.market, spec.fleet("token", 2), spec.demand)
    group = result.plans[-1].group_of(big)
    assert len(set(group)) == 2
    by_worker = defaultdict(list)
    for turn in result.turns:
        by_worker[turn.worker].append(turn)
    for worker in group:
        assert any(t.model == big for t in by_worker[worker])
    assert any(t.model != big for w in group for t in by_worker[w])   # the 7Bs share the group's devices
    for turns in by_worker.values():
        turns.sort(key=lambda t: t.start)
        assert all(b.start >= a.end - 1e-9 for a, b in zip(turns, turns[1:]))
    assert all(r.error is None for r in result.records)
