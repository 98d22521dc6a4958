"""Side-by-side results: a JSON and a Markdown table per contender, and PNG plots.

Input is what metrics.summarize returns per contender (same trace, same SLO), optionally a
rate sweep per contender ({rate: attainment}), the raw records (for latency CDFs) and the
workers' (worker, model, start, end) turns (for a timeline of which model ran when).
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

from load_tests.metrics import RequestRecord, Turn

logger = logging.getLogger(__name__)

COLUMNS = ("attainment_strict", "attainment_cumulative", "goodput_rps", "ttft_p50_s",
           "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")


def max_rate_at(attainments_by_rate: Mapping[float, float], threshold: float = 0.9) -> float | None:
    """Highest arrival rate that still reaches `threshold` attainment, interpolated.

    Rates are scanned in increasing order. Let r_b be the first rate whose attainment a_b is
    below the threshold and r_a (attainment a_a >= threshold) the rate before it: the answer
    is where the straight line between (r_a, a_a) and (r_b, a_b) crosses the threshold,
    r_a + (a_a - threshold) / (a_a - a_b) * (r_b - r_a). Later rates are ignored (a noisy
    recovery above the threshold does not count). If no rate falls below, the highest rate
    tested is returned (a lower bound); if the lowest rate is already below, None.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if not attainments_by_rate:
        raise ValueError("attainments_by_rate is empty")
    points = sorted((float(r), float(a)) for r, a in attainments_by_rate.items())
    if points[0][1] < threshold:
        return None
    for (r_a, a_a), (r_b, a_b) in zip(points, points[1:]):
        if a_b < threshold:
            return r_a + (a_a - threshold) / (a_a - a_b) * (r_b - r_a)
    return points[-1][0]


def build_report(summaries: Mapping[str, dict], *,
                 sweeps: Mapping[str, Mapping[float, float]] | None = None,
                 threshold: float = 0.9, baseline: str | None = None) -> dict[str, dict]:
    """{contender: {column: value}}; with a baseline, also goodput and max-rate ratios to it."""
    if not summaries:
        raise ValueError("no contenders to report")
    if baseline is not None and baseline not in summaries:
        raise ValueError(f"baseline {baseline!r} is not a contender: {sorted(summaries)}")
    rate_key = f"max_rate_at_{round(threshold * 100)}"
    report = {}
    for name, s in summaries.items():
        row = {k: s.get(k) for k in COLUMNS}
        row["num_requests"] = s.get("num_requests")
        row["num_errors"] = s.get("num_errors")
        if "switches_per_s_mean" in s:
            row["switches_per_s_mean"] = s["switches_per_s_mean"]
        if sweeps and name in sweeps:
            row[rate_key] = max_rate_at(sweeps[name], threshold)
            row["sweep"] = {str(r): a for r, a in sorted(sweeps[name].items())}
        report[name] = row
    if baseline is not None:
        base = report[baseline]
        for row in report.values():
            for key in ("goodput_rps", rate_key):
                if key in row:
                    row[f"{key}_vs_{baseline}"] = _ratio(row.get(key), base.get(key))
    return report


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}"
    return str(v)


def to_markdown(report: Mapping[str, dict], title: str = "") -> str:
    keys = [k for k in next(iter(report.values())) if k != "sweep"]
    for row in report.values():
        keys += [k for k in row if k not in keys and k != "sweep"]
    lines = [f"## {title}", ""] if title else []
    lines.append("| contender | " + " | ".join(keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for name, row in report.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_attainment_vs_rate(sweeps: Mapping[str, Mapping[float, float]], path: Path,
                            threshold: float = 0.9) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, sweep in sweeps.items():
        rates = sorted(sweep)
        ax.plot(rates, [100 * sweep[r] for r in rates], "o-", label=name)
    ax.axhline(100 * threshold, color="gray", linestyle="--", linewidth=1)
    ax.set(xlabel="arrival rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_cdf(values_by_contender: Mapping[str, Sequence[float]], path: Path,
             xlabel: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in values_by_contender.items():
        v = sorted(values)
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=name)
    ax.set(xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(turns: Sequence[Turn], path: Path, title: str = "") -> Path:
    """One row per worker, one coloured bar per turn, one colour per model."""
    plt = _pyplot()
    workers = sorted({t.worker for t in turns})
    models = sorted({t.model for t in turns})
    cmap = plt.get_cmap("tab20")
    colour = {m: cmap(i % 20) for i, m in enumerate(models)}
    fig, ax = plt.subplots(figsize=(8, 1 + 0.5 * max(1, len(workers))))
    for row, worker in enumerate(workers):
        mine = [t for t in turns if t.worker == worker]
        ax.broken_barh([(t.start, t.end - t.start) for t in mine], (row - 0.4, 0.8),
                       facecolors=[colour[t.model] for t in mine])
    ax.set_yticks(range(len(workers)), workers)
    ax.set(xlabel="time (s)", title=title)
    if len(models) <= 20:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour[m]) for m in models]
        ax.legend(handles, models, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "contender"


def write_report(out_dir: str | Path, summaries: Mapping[str, dict], *,
                 sweeps: Mapping[str, Mapping[float, float]] | None = None,
                 records: Mapping[str, Sequence[RequestRecord]] | None = None,
                 turns: Mapping[str, Sequence[Turn]] | None = None,
                 threshold: float = 0.9, baseline: str | None = None,
                 title: str = "tokenmux load test") -> dict[str, Path]:
    """Write report.json, report.md and the plots the inputs allow; returns {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(summaries, sweeps=sweeps, threshold=threshold, baseline=baseline)
    files = {"json": out / "report.json", "markdown": out / "report.md"}
    files["json"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    files["markdown"].write_text(to_markdown(report, title))
    if sweeps:
        files["attainment_vs_rate"] = plot_attainment_vs_rate(
            sweeps, out / "attainment_vs_rate.png", threshold)
    if records:
        ok = {n: [r for r in rs if r.ok] for n, rs in records.items()}
        files["ttft_cdf"] = plot_cdf({n: [r.ttft for r in rs] for n, rs in ok.items()},
                                     out / "ttft_cdf.png", "TTFT (s)")
        files["tbt_cdf"] = plot_cdf({n: [g for r in rs for g in r.tbts] for n, rs in ok.items()},
                                    out / "tbt_cdf.png", "TBT (s)")
    for name, ts in (turns or {}).items():
        if ts:
            files[f"timeline_{name}"] = plot_timeline(ts, out / f"timeline_{_slug(name)}.png",
                                                      title=name)
    logger.info("report written to %s: %s", out, ", ".join(p.name for p in files.values()))
    return files
