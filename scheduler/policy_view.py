"""What the token-level policy's parts (BatchLoads, RoundPlanner, PrefillBudget, SmoothStreams)
read of the policy: a read-only view of its request tables, its config and its estimator.

A part holds this view, never the policy, so it can be built and tested on plain tables
(nano-vllm's Scheduler holds a BlockManager, not the engine). The tables are the policy's own
containers, shared and mutated in place by the policy alone; the view types them as read-only
mappings so a part cannot edit a queue behind the policy's back.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from scheduler.estimator import StepLatencyEstimator
from scheduler.group_turns import GroupTurns
from scheduler.scheduler_config import SchedulerConfig, admission_alpha
from scheduler.request import Request


@dataclass(frozen=True)
class PolicyView:
    models: Mapping[str, object]  # registered models by name (a part reads the names only)
    waiting: Mapping[str, Sequence[Request]]  # per model, WAITING requests, oldest first
    running: Mapping[str, Sequence[Request]]  # per model, RUNNING or SWAPPED requests, oldest first
    requests: Mapping[str, Request]  # unfinished requests by id
    resident: Set[str]  # models whose weights are on the device now (the engine's hint)
    estimator: StepLatencyEstimator
    config: SchedulerConfig
    groups: GroupTurns = field(default_factory=GroupTurns)  # tensor-parallel groups this device follows

    @property
    def admission_alpha(self) -> float:
        """The alpha a round may reach with a new batch admitted (the config's, or by its measure)."""
        return admission_alpha(self.config)
