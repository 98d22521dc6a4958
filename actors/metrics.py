"""Every tokenmux metric, named once, and the one way each reaches Ray (`ray.util.metrics`).

Names follow vLLM's (`time_to_first_token_seconds`, `num_requests_running`, ...), so a vLLM
user's queries and alerts carry over; what only tokenmux has (swaps, turns, the quota rule's
alpha, handoffs, placement, device telemetry) sits beside them under the same prefix.

What Prometheus sees is not the name given to Ray. Ray 2.60 drops a metric whose name holds
':' (vLLM's own `vllm:` prefix; vLLM on Ray rewrites it to `vllm_` for the same reason), and
its exporter prefixes `ray_`. So the catalogue names are `tokenmux_...` and Prometheus has
`ray_tokenmux_...`; a counter's name ends in `_total` here and stays so there; a histogram
has Prometheus' series `_bucket{le}` (cumulative, with `le="+Inf"`), `_sum` and `_count`.

Histograms are kept here, not in Ray's Histogram: Ray takes one call per observed value
(~3 us of the flusher thread each, no call takes many), and at a tiny model's 7,000 tokens a
second the inter-token histogram alone cost 2% of the engine's time. `_Histogram` bins the
values of a flush itself and sets one Ray Gauge per series to its running total: per flush,
one call per bucket and label set, whatever the token rate. Prometheus' histogram_quantile
reads any `_bucket` series with `le`; the exported TYPE is gauge, the running totals restart
with the process like a counter's. `_sum` is exact (Ray's was made from bucket midpoints).
Every series also carries Ray's own labels
(`NodeAddress`, `WorkerId`, `SessionName`, ...). `prometheus_name` gives the exported name;
docs and dashboards use it.

`MetricsExporter` makes each Ray metric on first use (a process only registers what it
records) and validates names and labels against the catalogue, so a typo fails at the
call, not silently in a dashboard. It is called off the per-token path: the engine keeps
plain local counters and a flusher thread exports them (actors/engine_metrics.py).
"""
from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

PROMETHEUS_PREFIX = "ray_"   # Ray's exporter puts it in front of every application metric

# Seconds. Wide enough for a CPU host (tiny models: ms steps) and a loaded GPU (tens of s).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0)
TURN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

MW = ("model", "worker")
DEV = ("device", "worker", "virtual")


@dataclass(frozen=True)
class MetricSpec:
    name: str                        # as given to Ray
    kind: str                        # counter | gauge | histogram
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    source: str = "engine"           # engine | router | placement | ingress | device

    def __post_init__(self) -> None:
        if self.kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"metric {self.name}: kind must be counter, gauge or histogram, got {self.kind!r}")
        if not self.name.startswith("tokenmux_") or ":" in self.name:
            raise ValueError(f"metric {self.name}: names start with tokenmux_ and hold no ':' (Ray drops those)")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: counters, and only counters, end in _total")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"metric {self.name}: histograms, and only histograms, have buckets")


def _specs(*rows) -> dict[str, MetricSpec]:
    return {row[0]: MetricSpec(*row) for row in rows}


CATALOG: dict[str, MetricSpec] = _specs(
    # -- the engine (one DeviceWorker), vLLM's names --------------------------------------
    ("tokenmux_time_to_first_token_seconds", "histogram", "Arrival to first token, per request.", MW, TTFT_BUCKETS),
    ("tokenmux_inter_token_latency_seconds", "histogram", "Gap between consecutive tokens of a request.", MW,
     ITL_BUCKETS),
    ("tokenmux_e2e_request_latency_seconds", "histogram", "Arrival to last token, per finished request.", MW,
     E2E_BUCKETS),
    ("tokenmux_num_requests_running", "gauge", "Requests with KV on the device.", MW),
    ("tokenmux_num_requests_waiting", "gauge", "Requests queued or swapped out to host memory.", MW),
    ("tokenmux_kv_cache_usage_perc", "gauge", "Used share of the worker's unified KV pool (0-1).", ("worker",)),
    ("tokenmux_prompt_tokens_total", "counter", "Prompt tokens prefilled.", MW),
    ("tokenmux_generation_tokens_total", "counter", "Tokens generated.", MW),
    ("tokenmux_request_success_total", "counter", "Requests finished, by finish reason (stop, length).",
     MW + ("finished_reason",)),
    # -- the engine, what only tokenmux has ------------------------------------------------
    ("tokenmux_swaps_total", "counter", "Weight copies from the host cache into a device slot.", MW),
    ("tokenmux_swap_bytes_total", "counter", "Bytes of weights copied into device slots.", MW),
    ("tokenmux_swap_wait_seconds_total", "counter", "Seconds steps waited for weights to reach a slot.", MW),
    ("tokenmux_model_switches_total", "counter", "Steps that ran another model than the step before.", MW),
    ("tokenmux_prefetch_hits_total", "counter", "Switches to the model the scheduler had named next (prefetched).",
     MW),
    ("tokenmux_turn_seconds", "histogram", "Length of a turn: consecutive steps of one model.", MW, TURN_BUCKETS),
    ("tokenmux_turn_quota_seconds", "gauge", "Time quota of the model's decode batch in the current round.", MW),
    ("tokenmux_quota_alpha", "gauge", "Alpha of the latest round of the quota rule: mean TBT / TBT SLO "
     "(> 1: overloaded).", ("worker",)),
    ("tokenmux_device_busy_seconds_total", "counter", "Seconds the device spent in steps of the model.", MW),
    ("tokenmux_kv_handoffs_total", "counter", "KV handoffs to a decode worker, by outcome (handed_off, kept).",
     MW + ("outcome",)),
    ("tokenmux_kv_handoff_bytes_total", "counter", "Bytes of KV handed off to decode workers.", MW),
    ("tokenmux_kv_handoff_seconds", "histogram", "Export of a request's KV to the decode worker's ack.", MW,
     TRANSFER_BUCKETS),
    # -- router, placement, ingress -------------------------------------------------------
    ("tokenmux_router_requests_total", "counter", "Requests the router sent to a worker.", MW, (), "router"),
    ("tokenmux_router_no_worker_total", "counter", "Requests no worker could take.", ("model",), (), "router"),
    ("tokenmux_router_inflight_requests", "gauge", "Requests dispatched and not yet released.", MW, (), "router"),
    ("tokenmux_placement_changes_total", "counter", "Models added to or removed from a worker, and role changes.",
     MW + ("change",), (), "placement"),
    ("tokenmux_placement_replicas", "gauge", "Workers the placement plan gives the model.", ("model",), (),
     "placement"),
    ("tokenmux_placement_plan_version", "gauge", "Version of the placement plan in force.", (), (), "placement"),
    ("tokenmux_catalog_changes_total", "counter", "Changes of the live model catalog (kind: add, update, remove, "
     "failed).", ("kind",), (), "placement"),
    ("tokenmux_ingress_requests_total", "counter", "Requests through the OpenAI ingress, by outcome.",
     ("model", "outcome"), (), "ingress"),
    ("tokenmux_slo_requests_total", "counter", "Finished requests judged against their SLO (met: true|false).",
     ("model", "met"), (), "ingress"),
    ("tokenmux_slo_goodput", "gauge", "Share of the model's requests of the last minute that met TTFT and mean "
     "TPOT SLOs (DistServe/vLLM goodput).", ("model",), (), "ingress"),
    # -- device telemetry (NVML, or the worker process on a virtual device) -----------------
    ("tokenmux_device_utilization", "gauge", "Device busy share (0-1): NVML GPU utilisation, or the worker "
     "process's CPU time per thread it owns on a virtual device.", DEV, (), "device"),
    ("tokenmux_device_memory_used_bytes", "gauge", "Device memory used (NVML), or the worker's RSS (virtual).",
     DEV, (), "device"),
    ("tokenmux_device_memory_total_bytes", "gauge", "Device memory (NVML), or the worker's budget (virtual).",
     DEV, (), "device"),
    ("tokenmux_device_power_watts", "gauge", "Board power draw (NVML only).", DEV, (), "device"),
    ("tokenmux_device_temperature_celsius", "gauge", "GPU temperature (NVML only).", DEV, (), "device"),
    ("tokenmux_device_pcie_bytes_per_second", "gauge", "PCIe throughput by direction (NVML), or the worker's "
     "host-to-device weight copies (virtual).", DEV + ("direction",), (), "device"),
)


def prometheus_name(name: str) -> str:
    """The metric's name as Prometheus sees it (histograms: the family; add _bucket etc.)."""
    spec(name)
    return PROMETHEUS_PREFIX + name


def spec(name: str) -> MetricSpec:
    found = CATALOG.get(name)
    if found is None:
        raise ValueError(f"unknown metric {name!r}; the catalogue is in actors/metrics.py")
    return found


class MetricsExporter:
    """Records into Ray metrics by catalogue name. Thread-safe; cheap after first use of a name."""

    def __init__(self, default_tags: dict[str, str] | None = None):
        self.default_tags = dict(default_tags or {})
        self._metrics: dict[str, object] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:   # Ray refuses 0 increments
            self._metric(name, "counter").inc(value, tags=self._tags(name, tags))

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        self._metric(name, "gauge").set(value, tags=self._tags(name, tags))

    def observe(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        self.observe_many(name, (value,), tags)

    def observe_many(self, name: str, values, tags: dict[str, str] | None = None) -> None:
        if values:
            self._metric(name, "histogram").add(values, self._tags(name, tags))

    def _tags(self, name: str, tags: dict[str, str] | None) -> dict[str, str]:
        merged = {**self.default_tags, **(tags or {})}
        labels = CATALOG[name].labels
        missing = [k for k in labels if k not in merged]
        if missing:
            raise ValueError(f"metric {name}: labels {missing} missing (it takes {list(labels)})")
        return {k: str(merged[k]) for k in labels}

    def _metric(self, name: str, kind: str):
        metric = self._metrics.get(name)
        if metric is not None:
            return metric
        s = spec(name)
        if s.kind != kind:
            raise ValueError(f"metric {name} is a {s.kind}, not a {kind}")
        from ray.util import metrics as ray_metrics

        with self._lock:
            if name not in self._metrics:
                if kind == "histogram":
                    made = _histogram(s)
                else:
                    made = (ray_metrics.Counter if kind == "counter" else ray_metrics.Gauge)(
                        name, s.help, tag_keys=s.labels)
                self._metrics[name] = made
        return self._metrics[name]


_histograms: dict[str, "_Histogram"] = {}   # one per process and name: every exporter adds to the same totals
_histograms_lock = threading.Lock()


def _histogram(s: MetricSpec) -> "_Histogram":
    with _histograms_lock:
        found = _histograms.get(s.name)
        if found is None:
            found = _histograms[s.name] = _Histogram(s)
        return found


class _Histogram:
    """A histogram binned here and exported as Prometheus' series, each a Ray Gauge holding
    its running total (see the module docstring)."""

    def __init__(self, s: MetricSpec) -> None:
        from ray.util import metrics as ray_metrics

        self.bounds = tuple(s.buckets)
        self.le = [_le(b) for b in self.bounds] + ["+Inf"]
        self._bucket = ray_metrics.Gauge(s.name + "_bucket", s.help, tag_keys=s.labels + ("le",))
        self._sum = ray_metrics.Gauge(s.name + "_sum", s.help, tag_keys=s.labels)
        self._count = ray_metrics.Gauge(s.name + "_count", s.help, tag_keys=s.labels)
        self._totals: dict[tuple, tuple[list[int], list[float]]] = {}   # label values -> (bins, [sum])
        self._lock = threading.Lock()

    def add(self, values, tags: dict[str, str]) -> None:
        key = tuple(tags.items())
        with self._lock:
            bins, total = self._totals.setdefault(key, ([0] * (len(self.bounds) + 1), [0.0]))
            for v in values:
                bins[bisect.bisect_left(self.bounds, v)] += 1   # v <= le: the first bound not below v
            total[0] += math.fsum(values)
            counts = list(bins)
            value_sum = total[0]
        cumulative = 0
        for le, n in zip(self.le, counts):
            cumulative += n
            self._bucket.set(cumulative, tags={**tags, "le": le})
        self._sum.set(value_sum, tags=tags)
        self._count.set(cumulative, tags=tags)


def _le(bound: float) -> str:
    """A bucket bound as Prometheus' clients write `le` (0.005, 1.0, 10.0)."""
    return repr(float(bound))
