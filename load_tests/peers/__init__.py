"""Peer systems that tokenmux is compared against, each behind a load-test `Target`.

What flows through: a workload's requests go through a peer's Target (same protocol as
tokenmux's own contenders, load_tests/driver.py), so the driver records the same
RequestRecords and metrics.py scores every contender on the same trace.

    serve_multiplexed.py  Ray Serve's `@serve.multiplexed`: transformers models swapped
                          in and out of each replica's LRU cache per request
"""
