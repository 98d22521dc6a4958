"""`tokenmux bench catalog` on one short pair (a few seconds of load), on the session Ray: every
floor is scored, no request of an untouched model fails, every request of the updated or
removed model is exact or an explicit error, the added model serves, and the catalog is put
back after the changes. Timing floors (the TTFT ratio, the memory change) are recorded by the
bench, not asserted here: a few seconds on a shared 2-core machine measure the machine."""
from __future__ import annotations

import httpx
import pytest

from tests.net import free_port


@pytest.mark.slow
def test_a_short_catalog_bench_scores_every_floor_and_loses_nothing(ray_session):
    from deploy.local import run_local
    from load_tests.bench.catalog_bench import (APP, FLOORS, MODELS, SERVER_ARGS, UPDATED, run_pairs,
                                                zoo_path)

    models = {name: zoo_path(zoo) for name, zoo in MODELS.items()}
    # a TTFT SLO no busy host misses: the edge's adaptive admission (429 after late first tokens,
    # which a loaded 2-core host gives with or without changes) stays out of what is asserted
    args = {**SERVER_ARGS, "slo": {"ttft_s": 30.0, "tbt_s": 5.0}}
    with run_local(models, port=free_port(), app_name=APP, **args) as url:
        r = run_pairs(url, pairs=1, rate=3.0, duration_s=5.0, drain_s=1.0, seed=1)
        served = httpx.get(f"{url}/admin/models", timeout=30).json()["models"]

    assert set(r["floors"]) == set(FLOORS)
    assert r["change_errors"] == []
    (pair,) = r["pairs"]
    assert set(pair["order"]) == {"baseline", "changes"}
    assert pair["changes"]["untouched_requests"] > 0 and pair["changes"]["touched_requests"] > 0
    assert r["untouched_failures"] == 0 and r["untouched_refused_429"] == [0], \
        pair["changes"]["untouched_failure_examples"]
    assert r["touched_unexplained"] == 0, pair["changes"]["touched_unexplained_examples"]
    assert r["touched_exact"] + r["touched_explicit_error"] == pair["changes"]["touched_requests"]
    assert r["add_to_first_token_s"] is not None and r["add_to_first_token_s"] > 0
    assert len(r["untouched_ttft_p99_ratios"]) == 1 and r["untouched_ttft_p99_ratio"] > 0
    assert r["rss_change_frac"] >= 0 and 0 <= r["kv_used_change"] <= 1
    # put back: the first four models, the updated one on its first checkpoint again
    assert sorted(served) == sorted(MODELS)
    assert served[UPDATED]["path"] == models[UPDATED] and served[UPDATED]["version"] > 2
