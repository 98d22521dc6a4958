"""Why token-level's requests missed near its crossing, from the records of
docs/results/loadtest-poisson-6seeds: per rate,
the share that missed TTFT and the share that met TTFT but missed mean TPOT; of those, how
many were short (30 tokens or fewer), how many waited 20 ms or more between their first and second frame, and how many would have met
the mean-TPOT SLO had that first gap been 5 ms.

    python3 load_tests/experiments/loadtest_poisson_6seeds/misses.py [RECORDS] [RATES]

RECORDS defaults to docs/results/loadtest-poisson-6seeds/loadtest-records.jsonl.gz, RATES to
5.685,6.2,6.761,8.04; the SLO is the run's own (the records' header). Prints JSON.
"""
import gzip, json, sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results" / "loadtest-poisson-6seeds"
path = sys.argv[1] if len(sys.argv) > 1 else RESULTS / "loadtest-records.jsonl.gz"
rates = [float(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "5.685,6.2,6.761,8.04").split(",")]
LONG_GAP_S, SHORT_GAP_S, SHORT_STREAM = 0.020, 0.005, 30
per_rate, tpot = {}, {"misses": 0, "short": 0, "first_gap_long": 0, "met_with_short_first_gap": 0}
with gzip.open(path, "rt") as f:
    for line in f:
        r = json.loads(line)
        if r["kind"] == "run":
            ttft_slo, tbt_slo = r["slo"]["ttft_s"], r["slo"]["tbt_s"]
            continue
        if r["kind"] != "request" or r["contender"] != "token" or r["rate"] not in rates:
            continue
        c = per_rate.setdefault(str(r["rate"]), {"requests": 0, "ttft_miss": 0, "tpot_miss": 0, "error": 0})
        c["requests"] += 1
        times = r["token_times"]
        if r["error"] or not times:
            c["error"] += 1
            continue
        if times[0] - r["arrival"] > ttft_slo:
            c["ttft_miss"] += 1
            continue
        n = len(times)
        if n < 2 or (times[-1] - times[0]) / (n - 1) <= tbt_slo:
            continue
        c["tpot_miss"] += 1
        tpot["misses"] += 1
        tpot["short"] += n <= SHORT_STREAM
        first_gap = min(t for t in times if t > times[0]) - times[0]
        tpot["first_gap_long"] += first_gap >= LONG_GAP_S
        tpot["met_with_short_first_gap"] += \
            (times[-1] - times[0] - max(0.0, first_gap - SHORT_GAP_S)) / (n - 1) <= tbt_slo
print(json.dumps({"slo": [ttft_slo, tbt_slo], "by_rate": per_rate, "tpot_misses": tpot}, indent=1))
