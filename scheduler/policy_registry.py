"""The one registry of scheduling policy names: "token" | "request" | "dedicated" -> a SchedulingPolicy.

Configs (EngineConfig, AppArgs, the simulator's FleetConfig), the CLI's choices and the load test's
contenders all read the names from here, so a new policy is registered once.
"""
from __future__ import annotations

from scheduler.dedicated import DedicatedPolicy
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BlockManager
from scheduler.policy import SchedulerConfig, SchedulingPolicy
from scheduler.request_level import RequestLevelPolicy
from scheduler.token_level import TokenLevelPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "token": TokenLevelPolicy,
    "request": RequestLevelPolicy,
    "dedicated": DedicatedPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def check_policy_name(name: str) -> str:
    """`name` if it names a policy, else ValueError listing the names."""
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return name


def make_policy(
    name: str,
    block_manager: BlockManager,
    host_block_manager: BlockManager | None = None,
    estimator: StepLatencyEstimator | None = None,
    config: SchedulerConfig | None = None,
) -> SchedulingPolicy:
    return POLICIES[check_policy_name(name)](block_manager, config, estimator, host_block_manager)
