"""Burst-traffic load tests: workloads in, side-by-side SLO reports out.

What flows through, in order (workloads, traces and metrics are the fleet planner's, in
cluster/planner/, shared with it):

    workloads.py  arrivals x model popularity x lengths  -> Workload (TraceRequest list)
    traces.py     a real trace CSV (Aegaeon / Azure 2023 / BurstGPT) -> Workload
    driver.py     Workload + a Target (HTTP or in-process) -> list[RequestRecord]  (open loop)
    metrics.py    records + SLO (+ worker turns) -> percentiles, strict and cumulative
                  attainment, goodput, model switches per second
    report.py     per-contender summaries (+ rate sweeps, records, turns) -> JSON, Markdown, PNGs

The harness is a user of tokenmux: it talks to the system only through a `Target`.
"""
