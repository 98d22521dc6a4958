"""Records -> results: attainment curves with CIs, max rates, ratios, the never-below check.

Everything the load test reports is a function of the per-request records
(load_tests/records.py) and an SLO, so a run can be re-scored under another SLO, threshold
or measure without re-running it (`tokenmux loadtest --rescore RECORDS`). One caveat, said
wherever it matters: the token-level scheduler plans with the SLO it was driven with, so
re-scoring its records under another SLO judges a schedule made for the first one (the
baselines ignore the SLO, so for them a re-score is what a re-run would measure).

Per trace and contender: each measured rate holds one summary per seed; a point's
attainment by each measure is the mean over seeds with a 95% interval (load_tests/stats.py).
The max rate at the threshold is read off those curves per measure, and the token
contender's max rate is divided by each other contender's, interval and censoring carried
through. The best Ray Serve configuration ("multiplexed-*") is the one with the highest max
rate by the sweep measure (ties: the higher attainment at its lowest rate).
"""
from __future__ import annotations

from typing import Mapping

from cluster.planner.metrics import MEASURES, RequestRecord, summarize
from load_tests.records import RecordSet
from load_tests.stats import LOWER_BOUND, MEASURED, Estimate, MeanCI, max_rate, mean_ci, not_below, rate_ratio
from scheduler.slo import SLO

METRICS = tuple(MEASURES)  # goodput, strict, cumulative
TOKEN = "token"
REQUEST = "request"
MULTIPLEXED_PREFIX = "multiplexed"
LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "tbt_p50_s", "tbt_p99_s",
                "goodput_rps", "strict_rps", "num_errors")


def point_summary(seeds: Mapping[int, list[RequestRecord]], slo: SLO) -> dict:
    """One rate of one contender: per-seed summaries, and per measure the mean and CI."""
    per_seed = {seed: summarize(recs, slo) for seed, recs in sorted(seeds.items())}
    out: dict = {}
    for metric in METRICS:
        key = MEASURES[metric][1]
        out[metric] = mean_ci([s[key] or 0.0 for s in per_seed.values()]).to_dict()
    for key in LATENCY_KEYS:
        values = [s[key] for s in per_seed.values() if s.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    out["num_seeds"] = len(per_seed)
    out["num_requests"] = sum(s["num_requests"] for s in per_seed.values())
    out["per_seed"] = {str(seed): {MEASURES[m][1]: s[MEASURES[m][1]] for m in METRICS} | {
        "num_requests": s["num_requests"], "num_errors": s["num_errors"]} for seed, s in per_seed.items()}
    return out


def curve(points: Mapping[float, dict], metric: str) -> dict[float, MeanCI]:
    return {float(rate): MeanCI(**p[metric]) for rate, p in points.items()}


def analyze_trace(records: RecordSet, trace: str, slo: SLO, threshold: float = 0.9,
                  metric: str = "goodput", devices: Mapping[str, int] | None = None) -> dict:
    """Everything reported for one trace (see the module docstring)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    rate_key = f"max_rate_at_{round(threshold * 100)}"
    contenders: dict[str, dict] = {}
    for name in records.contenders():
        selected = records.select(name, trace)
        if not selected:
            continue
        points = {rate: point_summary(seeds, slo) for rate, seeds in selected.items()}
        contenders[name] = {
            "devices": (devices or {}).get(name, 1),
            "points": {str(rate): p for rate, p in points.items()},
            rate_key: {m: max_rate(curve(points, m), threshold).to_dict() for m in METRICS},
        }
    out: dict = {"trace": trace, "measure": metric, "threshold": threshold,
                 "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "contenders": contenders}
    muxes = [n for n in contenders if n.startswith(MULTIPLEXED_PREFIX)]
    best_mux = _best(contenders, muxes, rate_key, metric)
    out["best_multiplexed"] = best_mux
    if TOKEN not in contenders:
        return out
    others = {n: n for n in contenders if n != TOKEN}
    if best_mux is not None:
        others["multiplexed"] = best_mux
    for label, name in others.items():
        for m in METRICS:
            suffix = "" if m == metric else f"_{m}"
            ratio = rate_ratio(_estimate(contenders[TOKEN], rate_key, m), _estimate(contenders[name], rate_key, m))
            key = f"token_vs_{label}_rate{suffix}"
            out[key] = ratio.value
            out[f"{key}_kind"] = ratio.kind
            out[f"{key}_ci"] = [ratio.lo, ratio.hi]
            if ratio.note:
                out[f"{key}_note"] = ratio.note
    if REQUEST in contenders:
        verdicts = {}
        for m in ("goodput", "strict"):
            tok = curve({float(r): p for r, p in contenders[TOKEN]["points"].items()}, m)
            req = curve({float(r): p for r, p in contenders[REQUEST]["points"].items()}, m)
            verdicts[m] = not_below(tok, req)
        out["token_never_below_request"] = all(v for v, _ in verdicts.values()) and all(
            rows for _, rows in verdicts.values())
        out["token_never_below_request_detail"] = {m: rows for m, (_, rows) in verdicts.items()}
    return out


def _estimate(row: dict, rate_key: str, metric: str) -> Estimate:
    return Estimate(**row[rate_key][metric])


def _best(contenders: dict, names: list[str], rate_key: str, metric: str) -> str | None:
    if not names:
        return None

    def key(name: str):
        e = _estimate(contenders[name], rate_key, metric)
        rank = {MEASURED: 1, LOWER_BOUND: 2}.get(e.kind, 0)
        lowest = min(contenders[name]["points"], key=float)
        return (rank, e.value or 0.0, contenders[name]["points"][lowest][metric]["mean"])

    return max(names, key=key)


def slo_variants(slo: SLO) -> dict[str, SLO]:
    """The SLO sensitivity table's rows: the measured SLO, TTFT:TPOT ratios of 16 and 100
    (Aegaeon's) at the measured TBT, and both scaled x0.5 and x2."""
    return {
        "measured": slo,
        "ttft:tpot=16": SLO(16 * slo.tbt_s, slo.tbt_s),
        "ttft:tpot=100": SLO(100 * slo.tbt_s, slo.tbt_s),
        "x0.5": SLO(0.5 * slo.ttft_s, 0.5 * slo.tbt_s),
        "x1": slo,
        "x2": SLO(2 * slo.ttft_s, 2 * slo.tbt_s),
    }


def slo_sensitivity(records: RecordSet, trace: str, slo: SLO, threshold: float = 0.9,
                    metric: str = "goodput") -> dict:
    """Max rates and token ratios with the same records re-scored under each SLO variant."""
    rows = {}
    rate_key = f"max_rate_at_{round(threshold * 100)}"
    for name, variant in slo_variants(slo).items():
        result = analyze_trace(records, trace, variant, threshold, metric)
        row = {"ttft_s": variant.ttft_s, "tbt_s": variant.tbt_s}
        for contender, data in result["contenders"].items():
            row[contender] = data[rate_key][metric]
        for key in ("token_vs_request_rate", "token_vs_multiplexed_rate"):
            if key in result:
                row[key] = result[key]
                row[f"{key}_kind"] = result[f"{key}_kind"]
                row[f"{key}_ci"] = result[f"{key}_ci"]
        rows[name] = row
    return {"measure": metric, "threshold": threshold, "rows": rows,
            "note": "re-scored from the same records; the token contender was scheduled for the measured SLO"}
