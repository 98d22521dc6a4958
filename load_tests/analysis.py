"""Records -> results: attainment curves with CIs, max rates, ratios, the never-below check.

Everything the load test reports is a function of the per-request records
(load_tests/records.py) and an SLO, so a run can be re-scored under another SLO, threshold
or measure without re-running it (`tokenmux loadtest --rescore RECORDS`). One caveat, said
wherever it matters: the token-level scheduler plans with the SLO it was driven with, so
re-scoring its records under another SLO judges a schedule made for the first one (the
baselines ignore the SLO, so for them a re-score is what a re-run would measure).

Per trace and contender: each measured rate holds one summary per seed; a point's
attainment by each measure is the mean over seeds with a 95% interval (load_tests/stats.py).
A sustained run (its records' run says `sustain`, load_tests/sustained.py) scores only the
requests of each point's scored window, and says per point and seed whether the rate was
held (the queue no longer at the window's end than at its start).
The max rate at the threshold is read off those curves per measure, and the token
contender's max rate is divided by each other contender's. The ratio's interval comes from
a paired bootstrap over the seeds both ran (the same arrival sequences), and the ratio on
each seed alone is kept beside it; where the seeds are not shared, from the two curves'
bands. The best Ray Serve configuration ("multiplexed-*") is the one with the highest max
rate by the sweep measure (ties: the higher attainment at its lowest rate).

Never below: token's mean attainment is at least request's less NEVER_BELOW_TOLERANCE at
every rate both ran, by goodput and by strict (`token_never_below_request`); beside it, the
weaker check on the intervals (`token_never_below_request_beyond_ci`: below only where
token's upper CI end is under request's lower end).
"""
from __future__ import annotations

from typing import Mapping

from cluster.planner.metrics import MEASURES, RequestRecord, summarize
from load_tests.records import RecordSet
from load_tests.stats import (LOWER_BOUND, MEASURED, Estimate, MeanCI, max_rate, mean_ci, not_below, not_below_points,
                              paired_ratio, rate_ratio)
from load_tests.sustained import SustainSpec
from scheduler.slo import SLO

METRICS = tuple(MEASURES)  # goodput, strict, cumulative
TOKEN = "token"
REQUEST = "request"
MULTIPLEXED_PREFIX = "multiplexed"
LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "tbt_p50_s", "tbt_p99_s",
                "goodput_rps", "strict_rps", "num_errors")
NEVER_BELOW_TOLERANCE = 0.03  # attainment token may fall short of request by, on the point estimates


def point_summary(seeds: Mapping[int, list[RequestRecord]], slo: SLO, rate: float | None = None,
                  sustain: SustainSpec | None = None) -> dict:
    """One rate of one contender: per-seed summaries, and per measure the mean and CI; a
    sustained point scores its window and says whether each seed held the rate."""
    if sustain is not None and rate is None:
        raise ValueError("a sustained point needs its rate")
    scored = {seed: sustain.scored(recs, rate) if sustain else recs for seed, recs in sorted(seeds.items())}
    per_seed = {seed: summarize(recs, slo) for seed, recs in scored.items()}
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
    if sustain is not None:
        held = {seed: sustain.held(recs, rate) for seed, recs in sorted(seeds.items())}
        for seed, h in held.items():
            out["per_seed"][str(seed)].update(h)
        out["held"] = all(h["held"] for h in held.values())
        out["num_seeds_held"] = sum(h["held"] for h in held.values())
    return out


def curve(points: Mapping[float, dict], metric: str) -> dict[float, MeanCI]:
    return {float(rate): MeanCI(**p[metric]) for rate, p in points.items()}


def analyze_trace(records: RecordSet, trace: str, slo: SLO, threshold: float = 0.9,
                  metric: str = "goodput", devices: Mapping[str, int] | None = None) -> dict:
    """Everything reported for one trace (see the module docstring)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    rate_key = f"max_rate_at_{round(threshold * 100)}"
    sustain = SustainSpec(**records.run["sustain"]) if records.run.get("sustain") else None
    contenders: dict[str, dict] = {}
    for name in records.contenders():
        selected = records.select(name, trace)
        if not selected:
            continue
        points = {rate: point_summary(seeds, slo, rate, sustain) for rate, seeds in selected.items()}
        contenders[name] = {
            "devices": (devices or {}).get(name, 1),
            "points": {str(rate): p for rate, p in points.items()},
            rate_key: {m: max_rate(curve(points, m), threshold).to_dict() for m in METRICS},
        }
    out: dict = {"trace": trace, "measure": metric, "threshold": threshold,
                 "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, "contenders": contenders,
                 "sustain": sustain.to_dict() if sustain else None}
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
            out[f"{key}_ci_open"] = [ratio.lo_open, ratio.hi_open]
            out[f"{key}_ci_from"] = "bands"
            if ratio.note:
                out[f"{key}_note"] = ratio.note
            paired = _paired(contenders[TOKEN], contenders[name], m, threshold)
            if paired is not None:
                out[f"{key}_ci"] = [paired["lo"], paired["hi"]]
                out[f"{key}_ci_open"] = [paired["lo_open"], paired["hi_open"]]
                out[f"{key}_ci_from"] = f"paired bootstrap over {len(paired['seeds'])} seeds"
                out[f"{key}_ci_bands"] = [ratio.lo, ratio.hi]
                out[f"{key}_per_seed"] = {s: e["value"] if e["kind"] == MEASURED else
                                          {"value": e["value"], "kind": e["kind"]}
                                          for s, e in paired["per_seed"].items()}
    if REQUEST in contenders:
        out |= never_below(contenders[TOKEN], contenders[REQUEST])
    return out


def never_below(token: dict, request: dict) -> dict:
    """Token vs request at every shared rate, by goodput and strict: on the point estimates
    (the verdict) and beyond the intervals (beside it); see the module docstring."""
    points, beyond, detail = {}, {}, {}
    for m in ("goodput", "strict"):
        tok = curve({float(r): p for r, p in token["points"].items()}, m)
        req = curve({float(r): p for r, p in request["points"].items()}, m)
        points[m] = not_below_points({r: c.mean for r, c in tok.items()}, {r: c.mean for r, c in req.items()},
                                     NEVER_BELOW_TOLERANCE)
        beyond[m] = not_below(tok, req)
        detail[m] = [row | {"below_beyond_ci": ci_row["below_beyond_ci"], "a_hi": ci_row["a_hi"],
                            "b_lo": ci_row["b_lo"]} for row, ci_row in zip(points[m][1], beyond[m][1])]
    return {"token_never_below_request": all(v for v, _ in points.values()),
            "token_never_below_request_tolerance": NEVER_BELOW_TOLERANCE,
            "token_never_below_request_by_measure": {m: v for m, (v, _) in points.items()},
            "token_never_below_request_beyond_ci": all(v for v, _ in beyond.values()) and all(
                rows for _, rows in beyond.values()),
            "token_never_below_request_detail": detail}


def _paired(a: dict, b: dict, metric: str, threshold: float) -> dict | None:
    """paired_ratio of two contenders' per-seed curves, or None unless they share seeds, each
    measured at the same rates (then the paired ratio is the headline's own curves)."""
    key = MEASURES[metric][1]

    def per_seed(data: dict) -> dict[int, dict[float, float]]:
        out: dict[int, dict[float, float]] = {}
        for rate, p in data["points"].items():
            for seed, s in p["per_seed"].items():
                out.setdefault(int(seed), {})[float(rate)] = s[key] or 0.0
        return out

    sa, sb = per_seed(a), per_seed(b)
    seeds = set(sa) & set(sb)
    grids = {frozenset(c) for side in (sa, sb) for s, c in side.items() if s in seeds}
    if not seeds or len(grids) != 1:   # a search's own rates per contender: the bands' interval stands
        return None
    return paired_ratio(sa, sb, threshold)


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
