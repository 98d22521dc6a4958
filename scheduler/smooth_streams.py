"""How a round's quotas become turns: whole (the default), or smooth streams.

`WholeTurns` (the default): each batch runs its quota as one turn, and prefill goes in
wherever the round's budget lets it (scheduler/prefill_budget.py).

`SmoothStreams` (`SchedulerConfig.smooth_streams`, off by default; `tokenmux bench colocate
--smooth`). What it is for: streams read as they arrive, as agents' tokens feeding a person,
where the longest gap matters rather than the mean. With every model of the round resident
and room to spare (alpha <= SMOOTH_ALPHA) the quotas run in slices, round-robin (a slice:
the steps that amortise the engine's cost of a turn, often one), and prefill is spread
between them: after each prefill step every decoding batch runs a slice, no prefill step is
longer than a rotation of slices, and a batch that starts decoding joins at once. A stream's
gap is then about a rotation plus one prefill chunk instead of the other batches' whole
turns plus every prefill that arrived meanwhile (agents that send their turns together). The
quotas, alpha and prefill budget stay the rule's; only the order of the steps changes. The
figure that earns it its place (docs/benchmarks.md, four agents on one device): TBT p99
against time-slicing 0.43 smooth, 0.81 at the defaults (floor 0.5). The price is TTFT and
throughput (chunks and one-step runs cost more per token), so goodput does not gain: off by
default.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from scheduler.batch_loads import BatchLoads
from scheduler.policy_view import PolicyView
from scheduler.round_planner import RoundPlanner
from scheduler.step_overhead import StepOverhead

if TYPE_CHECKING:
    from scheduler.scheduler_output import SchedulerOutput

SMOOTH_ALPHA = 0.5  # rounds up to this alpha run in slices and spread prefill


class WholeTurns:
    """Each batch's quota is one turn; no decode is owed between prefill steps."""

    rotation_s = math.inf  # no cap on a prefill step beyond the round's budget

    @property
    def decode_first(self) -> bool:
        """Must a decode turn run before the next prefill step?"""
        return False

    def start_round(self, order: tuple[str, ...], quotas: dict[str, float], alpha: float, held: bool) -> None:
        """A new round serves `order` with `quotas` at `alpha` (`held`: it holds batches)."""

    def turn_s(self, model: str, quota: float) -> float:
        """The part of `model`'s `quota` its turn takes now."""
        return quota

    def after(self, output: SchedulerOutput, now: float, new_round: Callable[[float], None]) -> None:
        """`output` was scheduled at `now`; `new_round` starts a round at once."""


class SmoothStreams(WholeTurns):
    def __init__(self, view: PolicyView, loads: BatchLoads, overhead: StepOverhead,
                 planner: RoundPlanner) -> None:
        self.view = view
        self.loads = loads
        self.overhead = overhead
        self.planner = planner
        self.rotation_s = math.inf  # a spread round's slices, one of each batch
        self._spread = False  # this round is smooth: every model resident, room to spare
        self._free_round = False  # and has more than one batch: quotas run in slices
        self._left: dict[str, float] = {}  # quota left to a batch whose turn ran a slice of it
        self._owed: set[str] = set()  # batches to run a slice before the next prefill

    @property
    def decode_first(self) -> bool:
        return bool(self._owed)

    def start_round(self, order: tuple[str, ...], quotas: dict[str, float], alpha: float, held: bool) -> None:
        # slices and spread prefill only in a round with room to spare: near the device's
        # capacity, and under overload, the round's batches are chosen by their slack
        # (overload.py), judged over whole turns and whole prefills
        self._left = {}
        self._spread = (set(order) <= self.view.resident and alpha <= SMOOTH_ALPHA and not held
                        and self.view.config.turn_overhead_frac is not None)
        self._free_round = self._spread and len(order) > 1
        self.rotation_s = sum(self._slice_s(m, quotas[m]) for m in order) if self._spread else math.inf
        self._owed = self._owed & set(order) if self._spread else set()

    def turn_s(self, model: str, quota: float) -> float:
        """In a free round a turn takes a slice of its quota, and the rest comes back at the
        end of the round, so a stream waits for the other batches' slices rather than their
        whole quotas."""
        quota = self._left.pop(model, quota)
        if not self._free_round or not math.isfinite(quota):
            return quota
        piece = self._slice_s(model, quota)
        if piece < quota:
            self._left[model] = quota - piece
            self.planner.requeue(model)
        return piece

    def after(self, output: SchedulerOutput, now: float, new_round: Callable[[float], None]) -> None:
        """After a prefill step (a group's, a chunk, a join) every decoding batch of the round
        runs a slice before the next one, so a stream's gap holds one prefill step rather than a
        burst of them."""
        if not output.is_prefill:
            self._owed.discard(output.model)
            return
        if not self._spread:
            return
        if output.model not in self.planner.quotas and len(output.partial) < len(output.requests):
            # a batch starts decoding: a new round takes it in at once, rather than after every
            # slice of this one
            new_round(now)
        self._owed = {m for m in self.planner.quotas if self.loads.decoding(m)}

    def _slice_s(self, model: str, quota: float) -> float:
        """One slice of a `quota` of `model`'s: the steps that amortise a turn's cost, all of
        the quota when less than half a step would be left."""
        step = self.loads.predict_decode(model)
        if not step > 0:
            return quota
        steps = max(1, int(self.overhead.turn_cost_s / self.view.config.turn_overhead_frac / step))
        return quota if quota - steps * step < step / 2 else steps * step
