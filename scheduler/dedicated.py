"""Dedicated serving: one model per device, the way most of a marketplace fleet runs today.

Prefill first (waiting requests join as soon as they fit), then decode of every running
request: plain continuous batching, the reference point for the multiplexing policies.
"""
from __future__ import annotations

from scheduler.kv_blocks import KVShape
from scheduler.policy import SchedulingPolicy
from scheduler.scheduler_output import SchedulerOutput
from scheduler.request import Request


class DedicatedPolicy(SchedulingPolicy):
    def __init__(self, *args, model: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = model  # None: the first model registered

    def add_model(self, name: str, kv_shape: KVShape, weight_bytes: int) -> None:
        super().add_model(name, kv_shape, weight_bytes)
        if self.model is None:
            self.model = name

    def remove_model(self, name: str) -> None:
        super().remove_model(name)
        if name == self.model:   # the device is free for the next model placement gives it
            self.model = next(iter(self.models), None)

    def add_request(self, request: Request) -> None:
        if request.model != self.model:
            raise ValueError(
                f"this worker is dedicated to model {self.model!r}; it cannot serve {request.model!r}"
            )
        super().add_request(request)

    def _choose(self, now: float) -> SchedulerOutput | None:
        model = self.model
        if model not in self.models:
            return None
        output = self._prefill_step(model, list(self.waiting[model])) if self.waiting[model] else None
        return output or self._decode_step(model, self.config.max_decode_steps)
