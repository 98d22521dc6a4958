"""Pure decisions of tokenmux, and the messages that carry them (stdlib only: never imports torch or ray).

What flows through: a GenerateRequest (messages.py) becomes a Request (request.py) and is
handed to a SchedulingPolicy (policy.py, by name from policy_registry.py). Each engine step asks `schedule(now)` for a
SchedulerOutput (scheduler_output.py) — one model, the requests to advance with each one's
num_scheduled_tokens, KV copies (KVCopy) to do first, the model to prefetch — runs it, and
hands a StepResult (the sampled tokens and the step's times) back to `update`, which returns
the finished requests. KV memory is accounted in blocks of a unified slab pool
(kv_blocks.py); step and switch times come from the StepLatencyEstimator (estimator.py);
decode turns are sized by the quota rule (quota.py). Policies: TokenLevelPolicy
(Aegaeon-style, token_level.py), RequestLevelPolicy (request_level.py) and
DedicatedPolicy (dedicated.py) share one interface, so the engine and the fleet
simulator in cluster/planner/ run any of them unchanged. A KV handoff moves a request between
policies through verbs (detach_request, reattach_request, adopt_request), never by editing
their queues.

Above the worker: routing.py picks a worker for a request from WorkerViews (built from each
worker's WorkerStats), placement.py plans which workers hold which models from a
LoadReport. Every message between actors is a typed dataclass of messages.py.
"""
from scheduler.dedicated import DedicatedPolicy
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BLOCK_SIZE, BlockManager, KVShape, blocks_for_tokens
from scheduler.messages import GenerateRequest, OutputFrame
from scheduler.policy_registry import make_policy
from scheduler.policy import SchedulerConfig, SchedulingPolicy
from scheduler.quota import QuotaPlan, decode_quotas
from scheduler.request import Request, RequestStatus
from scheduler.request_level import RequestLevelPolicy
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler_output import KVCopy, SchedulerOutput, StepResult
from scheduler.slo import SLO
from scheduler.token_level import TokenLevelPolicy

__all__ = [
    "BLOCK_SIZE", "BlockManager", "DedicatedPolicy", "GenerateRequest", "KVCopy", "KVShape", "OutputFrame",
    "QuotaPlan", "Request", "RequestLevelPolicy", "RequestStatus", "SLO", "SamplingParams",
    "SchedulerConfig", "SchedulerOutput", "SchedulingPolicy", "StepLatencyEstimator", "StepResult",
    "TokenLevelPolicy", "blocks_for_tokens", "decode_quotas", "make_policy",
]
