"""Policy names for configs and CLIs: "token" | "request" | "dedicated" -> a SchedulingPolicy."""
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


def make_policy(
    name: str,
    block_manager: BlockManager,
    host_block_manager: BlockManager | None = None,
    estimator: StepLatencyEstimator | None = None,
    config: SchedulerConfig | None = None,
) -> SchedulingPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(block_manager, config, estimator, host_block_manager)
