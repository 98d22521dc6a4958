"""What each tokenmux dashboard shows: panels as plain data (title, PromQL, unit).

Queries use the names Prometheus sees (`ray_tokenmux_*`, actors/metrics.py) and fixed
`[1m]` windows, so each runs as written against Prometheus (tests do exactly that).
`nvml_only` marks panels that only a GPU host can fill (power, temperature): a virtual
device has neither, and tokenmux exports no stand-in zeros for them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    stacked: bool = False
    nvml_only: bool = False


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    panels: tuple[PanelSpec, ...]


def _q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, by: str) -> tuple[Query, ...]:
    return tuple(_q(f"histogram_quantile({p}, sum by ({by}, le) (rate(ray_{metric}_bucket[1m])))",
                    f"p{int(p * 100)} {{{{{by}}}}}") for p in (0.5, 0.99))


def _rate(metric: str, by: str) -> str:
    return f"sum by ({by}) (rate(ray_{metric}[1m]))"


FLEET = DashboardSpec("tokenmux-fleet", "tokenmux: fleet overview",
                      "Throughput, queues, overload (alpha), goodput and placement of the whole cluster.", (
    PanelSpec("Generated tokens/s by model", (_q(_rate("tokenmux_generation_tokens_total", "model"), "{{model}}"),),
              stacked=True),
    PanelSpec("Ingress requests/s by outcome", (_q(_rate("tokenmux_ingress_requests_total", "outcome"),
                                                  "{{outcome}}"),), "reqps"),
    PanelSpec("Requests running / waiting", (_q("sum(ray_tokenmux_num_requests_running)", "running"),
                                             _q("sum(ray_tokenmux_num_requests_waiting)", "waiting"))),
    PanelSpec("Quota rule alpha by worker (> 1: overloaded)",
              (_q("max by (worker) (ray_tokenmux_quota_alpha)", "{{worker}}"),),
              description="mean TBT / TBT SLO of the latest decode round"),
    PanelSpec("Goodput by model (last minute)", (_q("max by (model) (ray_tokenmux_slo_goodput)", "{{model}}"),),
              "percentunit"),
    PanelSpec("KV cache usage by worker", (_q("max by (worker) (ray_tokenmux_kv_cache_usage_perc)",
                                              "{{worker}}"),), "percentunit"),
    PanelSpec("Placement: replicas by model", (_q("max by (model) (ray_tokenmux_placement_replicas)",
                                                  "{{model}}"),)),
    PanelSpec("Placement changes (5 min)", (_q("sum by (change) (increase(ray_tokenmux_placement_changes_total[5m]))",
                                               "{{change}}"),)),
    PanelSpec("Router: requests/s by worker", (_q(_rate("tokenmux_router_requests_total", "worker"), "{{worker}}"),),
              "reqps"),
    PanelSpec("Router: requests no worker could take /s",
              (_q(_rate("tokenmux_router_no_worker_total", "model"), "{{model}}"),), "reqps"),
    PanelSpec("KV handoffs/s by outcome", (_q(_rate("tokenmux_kv_handoffs_total", "outcome"), "{{outcome}}"),)),
))

MODELS = DashboardSpec("tokenmux-models", "tokenmux: per-model latency and goodput",
                       "vLLM-style latency percentiles per model, and SLO goodput as DistServe defines it.", (
    PanelSpec("Time to first token", _quantiles("tokenmux_time_to_first_token_seconds", "model"), "s"),
    PanelSpec("Inter-token latency", _quantiles("tokenmux_inter_token_latency_seconds", "model"), "s"),
    PanelSpec("End-to-end request latency", _quantiles("tokenmux_e2e_request_latency_seconds", "model"), "s"),
    PanelSpec("Goodput, rolling (ingress)", (_q("max by (model) (ray_tokenmux_slo_goodput)", "{{model}}"),),
              "percentunit"),
    PanelSpec("Goodput from SLO verdicts (1 min)",
              (_q('sum by (model) (rate(ray_tokenmux_slo_requests_total{met="true"}[1m])) / '
                  "sum by (model) (rate(ray_tokenmux_slo_requests_total[1m]))", "{{model}}"),), "percentunit"),
    PanelSpec("Finished requests/s by reason",
              (_q(_rate("tokenmux_request_success_total", "model, finished_reason"),
                  "{{model}} {{finished_reason}}"),), "reqps"),
    PanelSpec("Prompt tokens/s", (_q(_rate("tokenmux_prompt_tokens_total", "model"), "{{model}}"),)),
    PanelSpec("Requests running by model", (_q("sum by (model) (ray_tokenmux_num_requests_running)", "{{model}}"),)),
    PanelSpec("Requests waiting by model", (_q("sum by (model) (ray_tokenmux_num_requests_waiting)", "{{model}}"),)),
))

WORKERS = DashboardSpec("tokenmux-workers", "tokenmux: per-worker turns and swaps",
                        "Which model holds each device (share of time, stacked: the timeline of turns), turn "
                        "lengths against quotas, weight swaps, prefetch and KV handoffs.", (
    PanelSpec("Device time by model, per worker (turn timeline)",
              (_q(_rate("tokenmux_device_busy_seconds_total", "worker, model"), "{{worker}} {{model}}"),),
              "percentunit", stacked=True),
    PanelSpec("Turn length", _quantiles("tokenmux_turn_seconds", "worker"), "s"),
    PanelSpec("Turn quota by model", (_q("max by (worker, model) (ray_tokenmux_turn_quota_seconds)",
                                         "{{worker}} {{model}}"),), "s"),
    PanelSpec("Alpha", (_q("max by (worker) (ray_tokenmux_quota_alpha)", "{{worker}}"),)),
    PanelSpec("Weight swaps/s", (_q(_rate("tokenmux_swaps_total", "worker"), "{{worker}}"),)),
    PanelSpec("Swap bytes/s", (_q(_rate("tokenmux_swap_bytes_total", "worker"), "{{worker}}"),), "Bps"),
    PanelSpec("Share of time waiting for weights", (_q(_rate("tokenmux_swap_wait_seconds_total", "worker"),
                                                       "{{worker}}"),), "percentunit"),
    PanelSpec("Model switches/s", (_q(_rate("tokenmux_model_switches_total", "worker"), "{{worker}}"),)),
    PanelSpec("Prefetch hit ratio", (_q(f"{_rate('tokenmux_prefetch_hits_total', 'worker')} / "
                                        f"{_rate('tokenmux_model_switches_total', 'worker')}", "{{worker}}"),),
              "percentunit"),
    PanelSpec("KV handoff latency", _quantiles("tokenmux_kv_handoff_seconds", "worker"), "s"),
    PanelSpec("KV handoff bytes/s", (_q(_rate("tokenmux_kv_handoff_bytes_total", "worker"), "{{worker}}"),), "Bps"),
    PanelSpec("Router requests in flight", (_q("sum by (worker) (ray_tokenmux_router_inflight_requests)",
                                               "{{worker}}"),)),
))

DEVICES = DashboardSpec("tokenmux-devices", "tokenmux: devices",
                        "NVML telemetry per GPU; on CPU hosts the worker process of each virtual device.", (
    PanelSpec("Utilisation", (_q("max by (worker, device, virtual) (ray_tokenmux_device_utilization)",
                                 "{{worker}} {{device}}"),), "percentunit"),
    PanelSpec("Memory used", (_q("max by (worker, device) (ray_tokenmux_device_memory_used_bytes)",
                                 "{{worker}} {{device}}"),), "bytes"),
    PanelSpec("Memory used / total", (_q("max by (worker, device) (ray_tokenmux_device_memory_used_bytes) / "
                                         "max by (worker, device) (ray_tokenmux_device_memory_total_bytes)",
                                         "{{worker}} {{device}}"),), "percentunit"),
    PanelSpec("PCIe throughput", (_q("max by (worker, device, direction) (ray_tokenmux_device_pcie_bytes_per_second)",
                                     "{{worker}} {{direction}}"),), "Bps"),
    PanelSpec("Power", (_q("max by (worker, device) (ray_tokenmux_device_power_watts)", "{{worker}} {{device}}"),),
              "watt", nvml_only=True),
    PanelSpec("Temperature", (_q("max by (worker, device) (ray_tokenmux_device_temperature_celsius)",
                                 "{{worker}} {{device}}"),), "celsius", nvml_only=True),
))

DASHBOARDS = (FLEET, MODELS, WORKERS, DEVICES)
