"""Side-by-side results: JSON, Markdown tables and PNG plots.

Two inputs. One run per contender (what metrics.summarize returns, same trace, same SLO),
its raw records (latency CDFs) and the workers' (worker, model, start, end) turns (a
timeline of which model ran when): `write_report`, used by the demo. And the analysed
sweeps of load_tests/analysis.py: attainment vs rate with 95% CI bands per contender and
measure, TTFT and TBT CDFs at one shared rate, and the published Markdown (tables of max
rates with CIs, ratios, the SLO sensitivity table), which also refreshes its section of
docs/benchmarks.md (between README_BEGIN and README_END; the names are older than the move).
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

from cluster.planner.metrics import RequestRecord, Turn

logger = logging.getLogger(__name__)

COLUMNS = ("attainment_goodput", "attainment_strict", "attainment_cumulative", "goodput_rps",
           "strict_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "tbt_p50_s", "tbt_p99_s")


def build_report(summaries: Mapping[str, dict]) -> dict[str, dict]:
    """{contender: {column: value}} of one run per contender (metrics.summarize's output)."""
    if not summaries:
        raise ValueError("no contenders to report")
    report = {}
    for name, s in summaries.items():
        row = {k: s.get(k) for k in COLUMNS}
        row["num_requests"] = s.get("num_requests")
        row["num_errors"] = s.get("num_errors")
        if "switches_per_s_mean" in s:
            row["switches_per_s_mean"] = s["switches_per_s_mean"]
        report[name] = row
    return report


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
                 records: Mapping[str, Sequence[RequestRecord]] | None = None,
                 turns: Mapping[str, Sequence[Turn]] | None = None,
                 title: str = "tokenmux load test") -> dict[str, Path]:
    """Write report.json, report.md and the plots the inputs allow; returns {name: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(summaries)
    files = {"json": out / "report.json", "markdown": out / "report.md"}
    files["json"].write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    files["markdown"].write_text(to_markdown(report, title))
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


# ---------------------------------------------------------------- the published run


_MEASURE_TITLES = {"goodput": "goodput (TTFT and mean TPOT within SLO)",
                   "strict": "strict (every token by its deadline)",
                   "cumulative": "Aegaeon cumulative (share of service time on time)"}


def plot_attainment_bands(result: dict, path: str | Path) -> Path:
    """Attainment vs rate per contender, one panel per measure: mean over seeds and its 95% CI band."""
    plt = _pyplot()
    measures = list(_MEASURE_TITLES)
    fig, axes = plt.subplots(1, len(measures), figsize=(5 * len(measures), 4), sharey=True)
    threshold = result.get("threshold", 0.9)
    for ax, measure in zip(axes, measures):
        for name, data in result["contenders"].items():
            rates = sorted(data["points"], key=float)
            if not rates:
                continue
            xs = [float(r) for r in rates]
            mean = [100 * data["points"][r][measure]["mean"] for r in rates]
            lo = [100 * max(0.0, data["points"][r][measure]["lo"]) for r in rates]
            hi = [100 * min(1.0, data["points"][r][measure]["hi"]) for r in rates]
            (line,) = ax.plot(xs, mean, "o-", markersize=3, label=name)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.axhline(100 * threshold, color="gray", linestyle="--", linewidth=1)
        ax.set(xscale="log", xlabel="arrival rate (req/s)", title=_MEASURE_TITLES[measure], ylim=(0, 105))
        _rate_ticks(ax, sorted({float(r) for data in result["contenders"].values() for r in data["points"]}))
    axes[0].set_ylabel("SLO attainment (%), mean and 95% CI over seeds")
    axes[-1].legend(fontsize="small", loc="lower left")
    fig.suptitle(f"{result['trace']} trace: TTFT SLO {result['slo']['ttft_s']:.4g} s, "
                 f"TBT SLO {result['slo']['tbt_s']:.4g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


MAX_RATE_TICKS = 8


def _rate_ticks(ax, rates: list[float]) -> None:
    """Label the measured rates on a log axis, no minor labels: matplotlib's default labels
    every minor tick of a span under a decade, and they print over each other."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    if not rates:
        return
    step = max(1, -(-len(rates) // MAX_RATE_TICKS))   # at most MAX_RATE_TICKS labels
    shown = rates[::step]
    ax.xaxis.set_major_locator(FixedLocator(shown))
    ax.set_xticklabels([f"{r:.3g}" for r in shown])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def cdf_rate(result: dict) -> float | None:
    """The rate the latency CDFs compare at: the highest rate token (or the only contender, a
    server driven with --url) met the threshold that the most contenders were measured at."""
    contenders = result["contenders"]
    token = contenders.get("token") or (next(iter(contenders.values())) if len(contenders) == 1 else None)
    if token is None or not token["points"]:
        return None
    threshold = result.get("threshold", 0.9)
    measure = result.get("measure", "goodput")
    passing = [float(r) for r, p in token["points"].items() if p[measure]["mean"] >= threshold]
    if not passing:
        return min(float(r) for r in token["points"])
    counts = {r: sum(str(r) in c["points"] for c in result["contenders"].values()) for r in passing}
    return max(passing, key=lambda r: (counts[r], r))


def plot_cdfs(records, trace: str, result: dict, prefix: str | Path) -> dict[str, Path]:
    """TTFT and TBT (per gap) CDFs of every contender measured at `cdf_rate`, all seeds pooled."""
    rate = cdf_rate(result)
    if rate is None:
        return {}
    ok: dict[str, list[RequestRecord]] = {}
    for name in result["contenders"]:
        seeds = records.select(name, trace).get(rate)
        if seeds:
            ok[name] = [r for recs in seeds.values() for r in recs if r.ok]
    prefix = Path(prefix)
    return {
        "ttft": plot_cdf({n: [r.ttft for r in rs] for n, rs in ok.items()},
                         prefix.with_name(prefix.name + "-ttft-cdf.png"), f"TTFT (s) at {rate:.3g} req/s"),
        "tbt": plot_cdf({n: [g for r in rs for g in r.tbts] for n, rs in ok.items()},
                        prefix.with_name(prefix.name + "-tbt-cdf.png"), f"TBT per gap (s) at {rate:.3g} req/s"),
    }


def _estimate_text(e: dict, unit: str = "") -> str:
    from load_tests.stats import Estimate

    return Estimate(**e).describe(unit)


def _ratio_text(result: dict, key: str) -> str:
    """A headline ratio: its value, what kind of number it is, and its interval with any open
    end written as a bound ("<= lo", ">= hi"), never as a closed interval."""
    from load_tests.stats import Estimate

    value = result.get(key)
    if value is None:
        return result.get(f"{key}_note") or result.get(f"{key}_kind", "-")
    lo, hi = result.get(f"{key}_ci", [None, None])
    lo_open, hi_open = result.get(f"{key}_ci_open", [lo is None, hi is None])
    kind = result.get(f"{key}_kind")
    interval = Estimate(value, lo, hi, "measured", lo_open=lo_open, hi_open=hi_open).interval_text()
    if kind == "lower bound":
        return f">= {value:.3g}" + interval
    if kind == "upper bound":
        return f"< {value:.3g}" + interval
    return f"{value:.3g}" + interval


def _goodput_by_rate(contenders: dict) -> list[str]:
    """Goodput and strict attainment (mean [95% CI] over seeds) of each contender at every rate
    it was measured; a sustained point adds how many seeds held the rate."""
    names = list(contenders)
    rates = sorted({float(r) for data in contenders.values() for r in data["points"]})
    lines = ["Attainment at each rate, goodput (TTFT and mean TPOT within SLO) / strict (every token by its "
             "deadline), mean [95% CI] over seeds; held: seeds whose queue did not grow over the scored window:",
             "", "| req/s | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for rate in rates:
        cells = []
        for name in names:
            point = next((p for r, p in contenders[name]["points"].items() if float(r) == rate), None)
            if point is None:
                cells.append("-")
                continue
            text = " / ".join(f"{point[m]['mean']:.2f} [{point[m]['lo']:.2f}, {point[m]['hi']:.2f}]"
                              for m in ("goodput", "strict"))
            if "held" in point:
                text += f"; held {point['num_seeds_held']}/{point['num_seeds']}"
            cells.append(text)
        lines.append(f"| {rate:.3g} | " + " | ".join(cells) + " |")
    return lines + [""]


def never_below_lines(result: dict) -> list[str]:
    """The never-below verdicts: on the point estimates (the verdict), beyond the CI (beside it)."""
    if "token_never_below_request" not in result:
        return []
    by = result.get("token_never_below_request_by_measure", {})
    tol = result.get("token_never_below_request_tolerance")
    return [f"- `token_never_below_request` (mean attainment >= request's - {tol} at every rate both ran): "
            f"{result['token_never_below_request']} (goodput {by.get('goodput')}, strict {by.get('strict')}); "
            f"beyond the CI (token's upper end under request's lower end counts as below): "
            f"{result.get('token_never_below_request_beyond_ci')}"]


def per_seed_text(result: dict, key: str) -> str:
    """Each seed's ratio alone ("0: 2.1, 1: >= 3.0, ..."), or "" when not paired."""
    per_seed = result.get(f"{key}_per_seed")
    if not per_seed:
        return ""

    def one(v) -> str:
        if isinstance(v, dict):
            sign = {"lower bound": ">= ", "upper bound": "< "}.get(v["kind"], "")
            return f"{sign}{v['value']:.3g}" if v["value"] is not None else v["kind"]
        return f"{v:.3g}"

    return ", ".join(f"{seed}: {one(v)}" for seed, v in per_seed.items())


def published_markdown(out_dir: str | Path, summary: dict) -> str:
    """The published run as Markdown: per trace, the contenders' max rates by each measure
    with CIs, the token ratios, the never-below check and the SLO table; then the models sweep."""
    out = Path(out_dir)
    lines = ["## Side by side: max arrival rate at 90% SLO attainment (one device)", ""]
    meta = summary.get("meta", {})
    for trace in summary["traces"]:
        result = json.loads((out / f"loadtest-{trace}.json").read_text())
        slo = result["slo"]
        lines += [f"### {trace} trace (TTFT SLO {slo['ttft_s']:.4g} s, TBT SLO {slo['tbt_s']:.4g} s)", "",
                  "| contender | devices | goodput | strict | cumulative |", "|---|---|---|---|---|"]
        for name, data in result["contenders"].items():
            rk = next(k for k in data if k.startswith("max_rate_at_"))
            cells = [_estimate_text(data[rk][m]) for m in ("goodput", "strict", "cumulative")]
            lines.append(f"| {name} | {data['devices']} | " + " | ".join(cells) + " |")
        lines += ["", "Max rate in req/s: mean-curve crossing and [95% CI] over "
                  f"{len(result['run'].get('preset', {}).get('seeds', []))} seeds x "
                  f"{result['run'].get('preset', {}).get('max_requests', '?')} requests per point.", ""]
        lines += _goodput_by_rate(result["contenders"])
        for label in ("request", "multiplexed"):
            parts = [f"{m}: {_ratio_text(result, f'token_vs_{label}_rate' + ('' if m == 'goodput' else '_' + m))}"
                     for m in ("goodput", "strict", "cumulative")]
            extra = f" (best: {result.get('best_multiplexed')})" if label == "multiplexed" else ""
            lines.append(f"- `token_vs_{label}_rate`{extra}: " + "; ".join(parts))
        lines += never_below_lines(result)
        sens = result.get("slo_sensitivity")
        if sens:
            lines += ["", f"SLO sensitivity ({sens['note']}), max rate at 90% goodput:", "",
                      "| SLO | TTFT s | TBT s | token | request | token / request | token / best multiplexed |",
                      "|---|---|---|---|---|---|---|"]
            for name, row in sens["rows"].items():
                tok = _estimate_text(row["token"]) if "token" in row else "-"
                req = _estimate_text(row["request"]) if "request" in row else "-"
                lines.append(f"| {name} | {row['ttft_s']:.4g} | {row['tbt_s']:.4g} | {tok} | {req} | "
                             f"{_ratio_text(row, 'token_vs_request_rate')} | "
                             f"{_ratio_text(row, 'token_vs_multiplexed_rate')} |")
        lines.append("")
    if "max_models_per_worker_at_90" in summary:
        lines.append(f"- `max_models_per_worker_at_90` (goodput, each model a Poisson stream of 0.1 req/s): "
                     f"{summary['max_models_per_worker_at_90']} ({summary['max_models_per_worker_at_90_kind']})")
    if meta.get("elapsed_s"):
        lines.append(f"- the whole run took {meta['elapsed_s'] / 60:.0f} min on this machine")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- loadtest-published:begin -->"
README_END = "<!-- loadtest-published:end -->"


def update_readme(path: str | Path, markdown: str) -> bool:
    """Replace the published load-test section of `path` (docs/benchmarks.md: between its markers);
    False if it has none."""
    path = Path(path)
    if not path.is_file():
        return False
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        logger.warning("%s has no %s ... %s markers; the load-test table is not refreshed", path,
                       README_BEGIN, README_END)
        return False
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    path.write_text(head + README_BEGIN + "\n" + markdown + README_END + tail)
    return True
