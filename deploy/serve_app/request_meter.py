"""RequestMeter: the ingress's view of every request, as metrics, recorded once as it ends.

    ClusterEngineClient(router, models, meter=RequestMeter())     # deploy/serve_app/app.py

Per request (never per token) it records the outcome (ok, error, cancelled) and, for a
finished request, whether it met its SLO the way vLLM's benchmark and DistServe define
goodput: TTFT <= the TTFT SLO and mean TPOT ((t_last - t_first) / (n - 1)) <= the TBT SLO,
with times from the frames' token_times and the request's arrival_time. Beside the counters
(`tokenmux_slo_requests_total{met}`), a gauge gives each model's rolling goodput: the share
of its requests that finished in the last `window_s` and met both SLOs. The ingress sees a
request end to end (through the router, a KV handoff, a re-dispatch), so this is where the
goodput is judged.
"""
from __future__ import annotations

import collections
import time

from actors.metrics import MetricsExporter
from scheduler.catalog import model_name
from scheduler.messages import FINISH_CANCELLED, GenerateRequest

GOODPUT_WINDOW_S = 60.0


def meets_slo(req: GenerateRequest, token_times: list[float]) -> bool:
    """TTFT and mean TPOT within the request's SLO (a request without tokens does not)."""
    if not token_times or not req.arrival_time:
        return False
    if token_times[0] - req.arrival_time > req.slo.ttft_s:
        return False
    if len(token_times) < 2:
        return True
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1) <= req.slo.tbt_s


class RollingGoodput:
    """Per model: (finish time, met) of the last window_s seconds."""

    def __init__(self, window_s: float = GOODPUT_WINDOW_S, clock=time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.clock = clock
        self._events: dict[str, collections.deque] = {}

    def add(self, model: str, met: bool) -> float:
        """Record one finished request; returns the model's goodput over the window."""
        now = self.clock()
        events = self._events.setdefault(model, collections.deque())
        events.append((now, met))
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        return sum(m for _, m in events) / len(events)


class RequestMeter:
    """Records each request as it ends (ClusterEngineClient calls `record` from its RequestState's end)."""

    def __init__(self, exporter: MetricsExporter | None = None, window_s: float = GOODPUT_WINDOW_S):
        self.exporter = exporter or MetricsExporter()
        self.goodput = RollingGoodput(window_s)

    def record(self, req: GenerateRequest, outcome: str, token_times: list[float]) -> None:
        """outcome: "ok", "error" or "cancelled" (the client left: no SLO verdict). A version's
        serving key (`name@vN`) counts under its model's name."""
        model = model_name(req.model)
        self.exporter.inc("tokenmux_ingress_requests_total", 1, {"model": model, "outcome": outcome})
        if outcome == FINISH_CANCELLED:
            return
        met = outcome == "ok" and meets_slo(req, token_times)
        self.exporter.inc("tokenmux_slo_requests_total", 1, {"model": model, "met": str(met).lower()})
        self.exporter.set("tokenmux_slo_goodput", self.goodput.add(model, met), {"model": model})
