"""Policy names come from one registry, and SchedulerConfig reaches the scheduler from every
config a user writes: EngineConfig, the Serve app's args and its serve config files."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from scheduler.policy import SchedulerConfig
from scheduler.policy_registry import POLICIES, POLICY_NAMES

MiB = 1 << 20
SMALL = {"budget_bytes": 8 * MiB, "kv_bytes": 2 * MiB, "num_slots": 1, "slab_bytes": 1 * MiB, "host_kv_bytes": 0}
CONFIGS = Path(__file__).resolve().parents[1] / "deploy" / "serve_app"


def test_every_name_list_is_the_registry():
    from deploy.cli.main import build_parser
    from load_tests.contenders import ENGINE_POLICIES

    assert ENGINE_POLICIES == POLICY_NAMES == tuple(POLICIES)
    for name in POLICY_NAMES:   # `tokenmux serve --policy` takes exactly the registered names
        assert build_parser().parse_args(["serve", "--models", "m", "--policy", name]).policy == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--models", "m", "--policy", "fifo"])


@pytest.mark.parametrize("make", ["engine", "app", "sim"])
def test_an_unknown_policy_is_refused_naming_the_known_ones(make):
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'; choose one of token, request, dedicated"):
        if make == "engine":
            from actors.engine import EngineConfig

            EngineConfig(policy="fifo")
        elif make == "app":
            from deploy.serve_app.app_args import parse_app_args

            parse_app_args({"models": {"a": "zoo:llama-tiny-a"}, "policy": "fifo"})
        else:
            from cluster.planner.devices import DeviceLayout, device_spec
            from cluster.planner.simulator import FleetConfig

            FleetConfig(1, DeviceLayout.carve(device_spec("H100"), 16 * 10**9), policy="fifo")


def test_scheduler_config_set_in_app_args_reaches_the_engines_policy():
    from actors.engine import Engine
    from deploy.serve_app.app_args import parse_app_args

    args = parse_app_args({"models": {"a": "zoo:llama-tiny-a"}, "policy": "token",
                           "scheduler": {"quota_max_s": 2.5, "quota_switch_factor": None,
                                         "slo_measure": "per_token"}})
    # what a DeviceWorker receives: the EngineConfig the args build, its SchedulerConfig inside
    engine = Engine(dataclasses.replace(args.engine_config(), **SMALL))
    assert engine.policy.config == SchedulerConfig(quota_max_s=2.5, quota_switch_factor=None,
                                                   slo_measure="per_token")
    # what is not set keeps SchedulerConfig's one default
    plain = Engine(dataclasses.replace(parse_app_args({"models": {"a": "zoo:llama-tiny-a"}}).engine_config(), **SMALL))
    assert plain.policy.config == SchedulerConfig()


def test_bad_scheduler_args_name_the_field():
    from deploy.serve_app.app_args import parse_app_args

    with pytest.raises(ValueError, match="scheduler.quota_max_s"):
        parse_app_args({"models": {"a": "zoo:llama-tiny-a"}, "scheduler": {"quota_max_s": 0}})
    with pytest.raises(ValueError, match="scheduler.quota_max"):
        parse_app_args({"models": {"a": "zoo:llama-tiny-a"}, "scheduler": {"quota_max": 1.0}})
    with pytest.raises(ValueError, match="scheduler.slo_measure"):
        parse_app_args({"models": {"a": "zoo:llama-tiny-a"}, "scheduler": {"slo_measure": "p99"}})


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config_gpu.yaml"])
def test_the_serve_configs_set_the_quota_rule(name):
    from deploy.serve_app.app_args import parse_app_args

    args = parse_app_args(yaml.safe_load((CONFIGS / name).read_text())["applications"][0]["args"])
    config = args.scheduler.config()
    assert (config.quota_max_s, config.quota_switch_factor) == (4.0, 8.0)


# SchedulerConfig fields a deployment does not set (ablations and engine-internal knobs); a
# new SchedulerConfig field must land in SchedulerArgs or here, so the two cannot drift apart
NOT_DEPLOYABLE = {"overload_control", "ttft_slack", "max_decode_steps"}


def test_scheduler_args_keep_in_step_with_scheduler_config():
    from deploy.serve_app.app_args import SchedulerArgs

    config_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    args_fields = set(SchedulerArgs.model_fields)
    assert args_fields <= config_fields, args_fields - config_fields
    assert config_fields - args_fields == NOT_DEPLOYABLE
    every = {name: getattr(SchedulerConfig(), name) for name in args_fields}
    assert SchedulerArgs(**every).config() == SchedulerConfig()
