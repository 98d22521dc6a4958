"""Request-level multiplexing, the baseline of ServerlessLLM and Ray Serve model multiplexing.

One model at a time owns the device: it runs until all its queued and running requests
have finished, and only then is the next model (the one whose oldest request has waited
longest) switched in. New arrivals of the running model join it (continuous batching);
requests of other models wait behind it, which is the head-of-line blocking that
token-level multiplexing removes.
"""
from __future__ import annotations

from scheduler.policy import SchedulingPolicy
from scheduler.scheduler_output import SchedulerOutput


class RequestLevelPolicy(SchedulingPolicy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active_model: str | None = None

    def _choose(self, now: float) -> SchedulerOutput | None:
        if self.active_model not in self.models or not self.num_unfinished(self.active_model):
            self.active_model = self._oldest_unfinished_model()
        model = self.active_model
        if model is None:
            return None
        # Prefill first (vLLM's order): waiting requests join as soon as they fit.
        output = self._prefill_step(model, list(self.waiting[model])) if self.waiting[model] else None
        if output is None:
            output = self._decode_step(model, self.config.max_decode_steps)
        if output is not None:
            output.prefetch_model = self._expected_next(model)
        return output

    def _expected_next(self, current: str) -> str | None:
        others = [r for r in self.requests.values() if r.model != current]
        return min(others, key=self._age_key).model if others else None
