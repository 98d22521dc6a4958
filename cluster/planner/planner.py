"""How many GPUs does this marketplace need? The fleet simulator, searched over GPU counts.

For each policy (token, request, dedicated) the planner simulates the workload on n
devices (cluster/planner/simulator.py: the real placement, routing and per-worker policies) and
measures SLO attainment with cluster/planner/metrics.py (strict per-token deadlines, goodput
or Aegaeon's cumulative measure). The answer for a policy is the fewest devices whose
attainment reaches the target *and stays there one device further*: attainment is not
monotone in n (one more worker can change a packing for the worse), so a lucky single
count is not an answer.

Search. `bisect` doubles n until the target is met, bisects down to the first count
that meets it, then verifies the neighbours: the two counts below (if either meets the
target, the search moves down and verifies again) and the one above (if it fails, the
search moves up to the next count that meets the target twice running). `scan` evaluates
every count from the lower bound, for a full curve. Dedicated starts at one device per
model: it gives every model a device, so it never answers fewer devices than models.

Tensor-parallel models (cluster/planner/marketplace.py) count every device of their group:
a GPU count is simulated workers, a TP-N model's group takes N of them (placement's
`groups`), and its steps hold every member (the simulator's `_as_group`). So no count below
the largest N is searched, and dedicated's starts at the sum of each model's devices.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from cluster.planner.devices import DeviceLayout
from cluster.planner.marketplace import Marketplace
from cluster.planner.metrics import summarize
from cluster.planner.simulator import FleetConfig, simulate
from cluster.planner.workloads import Workload
from scheduler.placement import PlacementConfig
from scheduler.policy import SchedulerConfig
from scheduler.routing import RoutingConfig
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

METRICS = {"strict": "attainment_strict", "goodput": "attainment_goodput", "cumulative": "attainment_cumulative"}
POLICIES = ("token", "request", "dedicated")
AEGAEON_QUOTA_S, AEGAEON_SWITCH_S = 4.0, 14 / 16   # Q_max = 4 s for a 14 GB swap at 16 GB/s


@dataclass(frozen=True)
class PlanSpec:
    """Everything a simulated fleet is, except its size and policy."""

    workload: Workload
    market: Marketplace
    layout: DeviceLayout
    slo: SLO
    demand: Mapping[str, float]                 # model -> arrivals/s: the first plan's estimate
    scheduler: SchedulerConfig
    placement: PlacementConfig
    routing: RoutingConfig
    replan_interval_s: float = 2.0
    metric: str = "strict"
    target: float = 0.9

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target!r}")

    def fleet(self, policy: str, num_workers: int) -> FleetConfig:
        placement = self.placement
        if policy == "dedicated":   # one model per device, no prefill/decode split
            placement = replace(placement, max_models_per_worker=1, split_load=math.inf, merge_load=1e300)
        # the policies plan by the deadlines the plan scores: strict and cumulative are per token
        scheduler = replace(self.scheduler, slo_measure="mean_tpot" if self.metric == "goodput" else "per_token")
        return FleetConfig(num_workers, self.layout, policy, self.slo, scheduler, placement,
                           self.routing, self.replan_interval_s)


@dataclass
class Point:
    gpus: int
    attainment: float
    metrics: dict           # every measure at this count
    wall_s: float
    stats: dict = field(repr=False, default_factory=dict)


@dataclass
class PolicyPlan:
    policy: str
    gpus: int | None        # None: no count up to max_gpus reaches the target
    points: dict[int, Point]

    @property
    def attainment(self) -> float | None:
        if self.gpus is not None:
            return self.points[self.gpus].attainment
        best = max(self.points.values(), key=lambda p: p.attainment, default=None)
        return best.attainment if best else None

    def to_dict(self) -> dict:
        at = self.points.get(self.gpus) if self.gpus is not None else None
        return {"gpus": self.gpus, "attainment": self.attainment,
                "metrics": at.metrics if at else None,
                "curve": {str(n): p.attainment for n, p in sorted(self.points.items())},
                "curve_metrics": {str(n): p.metrics for n, p in sorted(self.points.items())},
                "sim_wall_s": {str(n): round(p.wall_s, 3) for n, p in sorted(self.points.items())}}


def quota_for_device(market: Marketplace, layout: DeviceLayout) -> float:
    """Q_max scaled from Aegaeon's choice by the switch cost: 4 s for a 0.875 s swap there,
    the same multiple of the mix's mean swap-in time on this device (a quota only has to
    amortise the switch; longer ones just lengthen every other model's wait)."""
    types = list(market.types.values())
    mean_switch = sum(t.device_weight_bytes for t in types) / len(types) / layout.device.h2d_bytes_per_s
    return round(AEGAEON_QUOTA_S * mean_switch / AEGAEON_SWITCH_S, 3)


def evaluate(spec: PlanSpec, policy: str, gpus: int, stop_early: bool = True) -> Point:
    """One GPU count. With `stop_early`, under the strict and goodput measures, the run stops
    once more requests have missed their TTFT than the target allows (the count fails either
    way; its attainment is then a lower estimate, flagged `stopped_early`)."""
    started = time.perf_counter()
    give_up = None if spec.metric == "cumulative" or not stop_early else int(
        (1 - spec.target) * len(spec.workload))
    result = simulate(spec.workload, spec.market, spec.fleet(policy, gpus), spec.demand, give_up)
    summary = summarize(result.records, spec.slo, turns=None)
    metrics = {name: summary.get(key) for name, key in METRICS.items()}
    metrics |= {"ttft_p99_s": summary["ttft_p99_s"], "tbt_p99_s": summary["tbt_p99_s"],
                "num_errors": summary["num_errors"],
                "stopped_early": result.stats["stopped_early_at_s"] is not None}
    value = metrics[spec.metric]
    if value is None:
        raise ValueError(f"metrics.summarize gives no {METRICS[spec.metric]!r}")
    return Point(gpus, float(value), metrics, time.perf_counter() - started, result.stats)


def search(spec: PlanSpec, policy: str, max_gpus: int, mode: str = "bisect",
           on_point: Callable[[str, Point], None] | None = None, only: int | None = None,
           evaluate_fn: Callable[..., Point] = evaluate) -> PolicyPlan:
    """Fewest GPUs for `policy` (see the module docstring); `only` evaluates that count alone,
    in full. `evaluate_fn(spec, policy, n, stop_early)` measures one count (the simulator)."""
    if mode not in ("bisect", "scan"):
        raise ValueError(f"search must be bisect or scan, got {mode!r}")
    # Every TP group counts all its devices: dedicated gives each model its own (N for a group),
    # and no policy serves a TP-N model on fewer than N.
    low = spec.market.dedicated_devices() if policy == "dedicated" else spec.market.max_tensor_parallel()
    if max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1, got {max_gpus}")
    points: dict[int, Point] = {}

    def meets(n: int) -> bool:
        if n not in points:
            points[n] = evaluate_fn(spec, policy, n)
            if on_point:
                on_point(policy, points[n])
        return points[n].attainment >= spec.target

    if only is not None:   # one count, measured in full (its attainment is the answer asked for)
        if policy == "dedicated" and only < low:
            logger.warning("dedicated needs one device per model (%d); %d given", low, only)
        points[only] = evaluate_fn(spec, policy, only, stop_early=False)
        if on_point:
            on_point(policy, points[only])
        return PolicyPlan(policy, only if points[only].attainment >= spec.target else None, points)
    if low > max_gpus:
        return PolicyPlan(policy, None, points)

    def stable(n: int) -> bool:
        return meets(n) and (n >= max_gpus or meets(n + 1))

    if mode == "scan":
        answer = next((n for n in range(low, max_gpus + 1) if stable(n)), None)
        return PolicyPlan(policy, answer, points)
    fail, n = low - 1, low
    while not meets(n):          # doubling: the first count that meets the target
        if n >= max_gpus:
            return PolicyPlan(policy, None, points)
        fail, n = n, min(max_gpus, max(n + 1, 2 * n))
    while n - fail > 1:          # bisect between the last failing and the first meeting count
        mid = (fail + n) // 2
        if meets(mid):
            n = mid
        else:
            fail = mid
    while True:                  # verify the neighbours: the curve need not be monotone
        below = [m for m in (n - 1, n - 2) if m >= low and meets(m)]
        if below:
            n = min(below)
            continue
        if stable(n):
            return PolicyPlan(policy, n, points)
        n = next((m for m in range(n + 1, max_gpus + 1) if stable(m)), None)
        return PolicyPlan(policy, n, points)


def savings(plans: Mapping[str, PolicyPlan]) -> dict[str, float | None]:
    """1 - gpus / dedicated's gpus, per policy (None when either has no answer)."""
    base = plans.get("dedicated")
    if base is None or base.gpus is None:
        return {p: None for p in plans}
    return {p: (None if plan.gpus is None else 1 - plan.gpus / base.gpus) for p, plan in plans.items()}


def table(plans: Mapping[str, PolicyPlan], metric: str, target: float) -> str:
    save = savings(plans)
    lines = [f"{'policy':<10} {'GPUs':>6} {metric + ' attainment':>22} {'vs dedicated':>13}"]
    for name, plan in plans.items():
        gpus = str(plan.gpus) if plan.gpus is not None else "none"
        att = f"{plan.attainment:.3f}" if plan.attainment is not None else "-"
        if plan.gpus is None and plan.points:
            att += f" (best, < {target})"
        s = save.get(name)
        vs = "-" if name == "dedicated" or s is None else f"{-100 * s:+.0f}%"
        lines.append(f"{name:<10} {gpus:>6} {att:>22} {vs:>13}")
    return "\n".join(lines)


def plot(plans: Mapping[str, PolicyPlan], metric: str, target: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, plan in plans.items():
        xs = sorted(plan.points)
        ax.plot(xs, [plan.points[n].attainment for n in xs], marker="o", label=name)
        if plan.gpus is not None:
            ax.axvline(plan.gpus, linestyle=":", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target:g}")
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"SLO attainment ({metric})")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
