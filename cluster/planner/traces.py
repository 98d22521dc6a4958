"""Replay real traces: read a CSV, pick a window, speed it up, map its models onto ours.

Three schemas are recognised from the header line:

| schema   | header                                                              | time column            |
|----------|---------------------------------------------------------------------|------------------------|
| aegaeon  | Request Time,Model Name,Input Length,Output Length                  | HH:MM:SS.fff from start |
| azure    | TIMESTAMP,ContextTokens,GeneratedTokens (no model column)           | datetime               |
| burstgpt | Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type | seconds from start     |

BurstGPT files may carry extra columns (Session ID, Elapsed time); they are ignored. Its
rows with `Response tokens` = 0 record failed requests; `drop_failed=True` leaves them
out (and logs how many). Any other malformed row raises `TraceError` naming the file and
line: a trace is never replayed with rows silently missing.

Timestamps have a resolution (Aegaeon's 1 ms, BurstGPT's 1 s): requests logged in the same
tick share one time, and a trace sped up to a higher rate would send them all at one
instant, a burst no client makes. `read_trace` spreads each such group evenly over its tick
(`spread_ties`), so a sped-up trace keeps its bursts but never stacks arrivals.
"""
from __future__ import annotations

import csv
import logging
import zlib
from datetime import datetime
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from cluster.planner.workloads import EmpiricalLengths, LongTail, Popularity, TraceRequest, Workload, sample_models

logger = logging.getLogger(__name__)

SCHEMAS: dict[str, tuple[str, ...]] = {
    "aegaeon": ("Request Time", "Model Name", "Input Length", "Output Length"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Model", "Request tokens", "Response tokens"),
}
# (time, model, input, output) column of each schema; azure has no model column
_COLUMNS: dict[str, tuple[str, str | None, str, str]] = {
    "aegaeon": ("Request Time", "Model Name", "Input Length", "Output Length"),
    "azure": ("TIMESTAMP", None, "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Model", "Request tokens", "Response tokens"),
}
UNASSIGNED_MODEL = "?"  # placeholder for traces without a model column
RESOLUTION_S = {"aegaeon": 1e-3, "azure": 1e-7, "burstgpt": 1.0}  # one tick of each schema's timestamps


class TraceError(ValueError):
    def __init__(self, path: str | Path, line: int, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem}")


def detect_schema(header: Sequence[str]) -> str:
    names = {h.strip() for h in header}
    for schema, required in SCHEMAS.items():
        if set(required) <= names:
            return schema
    raise ValueError(f"unknown trace header {list(header)}; known schemas: "
                     + "; ".join(f"{k}: {','.join(v)}" for k, v in SCHEMAS.items()))


def _parse_clock(text: str) -> float:
    """'HH:MM:SS.fff' (hours may exceed 23) -> seconds."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"time {text!r} is not HH:MM:SS.fff")
    h, m, s = int(parts[0]), int(parts[1]), float(parts[2])
    if h < 0 or not 0 <= m < 60 or not 0 <= s < 60:
        raise ValueError(f"time {text!r} is out of range")
    return h * 3600 + m * 60 + s


def write_aegaeon(workload: Sequence[TraceRequest], path: str | Path) -> Path:
    """A workload as an Aegaeon-format trace (millisecond ticks), so `tokenmux plan --trace`
    replays exactly what a load test offered."""
    lines = [",".join(SCHEMAS["aegaeon"])]
    for r in workload:
        ms = round(r.arrival_s * 1000)
        h, rest = divmod(ms, 3_600_000)
        m, rest = divmod(rest, 60_000)
        lines.append(f"{h:02d}:{m:02d}:{rest / 1000:06.3f},{r.model},{r.input_len},{r.output_len}")
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def _parse_datetime(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> POSIX seconds (the fraction may have 7 digits)."""
    head, _, frac = text.strip().partition(".")
    if frac and not frac.isdigit():
        raise ValueError(f"timestamp {text!r} has a malformed fraction")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def _parse_seconds(text: str) -> float:
    t = float(text)
    if not np.isfinite(t) or t < 0:
        raise ValueError(f"timestamp {text!r} must be a finite number >= 0")
    return t


def _parse_count(text: str, column: str, minimum: int) -> int:
    try:
        x = float(text)
        if not x.is_integer():
            raise ValueError
    except ValueError:
        raise ValueError(f"{column} {text!r} is not an integer") from None
    n = int(x)
    if n < minimum:
        raise ValueError(f"{column} must be >= {minimum}, got {n}")
    return n


def read_rows(path: str | Path, *, drop_failed: bool = True) -> tuple[str, list[TraceRequest]]:
    """(schema, requests in file order) with arrival times re-based so the first is 0.

    Azure rows get the placeholder model UNASSIGNED_MODEL.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, 1, "empty file: no header")
        try:
            schema = detect_schema(header)
        except ValueError as e:
            raise TraceError(path, 1, str(e)) from None
        col = {h.strip(): i for i, h in enumerate(header)}
        time_col, model_col, in_col, out_col = _COLUMNS[schema]
        parse_time = {"aegaeon": _parse_clock, "azure": _parse_datetime,
                      "burstgpt": _parse_seconds}[schema]
        raw: list[tuple[float, str, int, int]] = []
        num_failed = 0
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue  # blank line (e.g. a trailing newline), not a request
            if len(row) != len(header):
                raise TraceError(path, line, f"expected {len(header)} columns, got {len(row)}")
            try:
                t = parse_time(row[col[time_col]].strip())
                model = row[col[model_col]].strip() if model_col else UNASSIGNED_MODEL
                if not model:
                    raise ValueError("model name is empty")
                n_in = _parse_count(row[col[in_col]].strip(), in_col, 1)
                failed_ok = schema == "burstgpt"  # 0 response tokens = a logged failure
                n_out = _parse_count(row[col[out_col]].strip(), out_col, 0 if failed_ok else 1)
            except ValueError as e:
                raise TraceError(path, line, str(e)) from None
            if n_out == 0:
                if not drop_failed:
                    raise TraceError(path, line, "failed request (0 response tokens); "
                                     "pass drop_failed=True to leave such rows out")
                num_failed += 1
                continue
            raw.append((t, model, n_in, n_out))
    if num_failed:
        logger.info("%s: left out %d failed requests (0 response tokens)", path, num_failed)
    t0 = min((r[0] for r in raw), default=0.0)
    return schema, [TraceRequest(t - t0, m, i, o) for t, m, i, o in raw]


def spread_ties(rows: Sequence[TraceRequest], resolution_s: float) -> list[TraceRequest]:
    """Rows sorted by arrival, each group sharing one timestamp spread evenly over the tick
    after it: k requests at t go to t, t + r/k, ..., t + (k-1) r/k (r the resolution)."""
    if not resolution_s > 0:
        raise ValueError(f"resolution_s must be > 0, got {resolution_s!r}")
    out: list[TraceRequest] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j].arrival_s == rows[i].arrival_s:
            j += 1
        k = j - i
        out += [TraceRequest(r.arrival_s + resolution_s * n / k, r.model, r.input_len, r.output_len)
                for n, r in enumerate(rows[i:j])]
        i = j
    return out


def read_azure(path: str | Path) -> list[TraceRequest]:
    schema, rows = read_rows(path)
    if schema != "azure":
        raise ValueError(f"{path} is a {schema} trace, not an Azure LLM 2023 trace")
    return rows


def lengths_from_azure(path: str | Path, **limits) -> EmpiricalLengths:
    """(input, output) lengths of the Azure LLM inference trace 2023 (code.csv or conv.csv),
    resampled in pairs; `limits` are EmpiricalLengths' scales and clips."""
    return _lengths(read_azure(path), limits)


def lengths_from_trace(path: str | Path, **limits) -> EmpiricalLengths:
    """(input, output) lengths of any trace `read_rows` reads (Azure, Aegaeon, BurstGPT),
    resampled in pairs: a trace's lengths under arrivals of any rate and length of run, where
    the file itself is too short to replay (Aegaeon's synthetic traces hold 60 s)."""
    return _lengths(read_rows(path)[1], limits)


def _lengths(rows: Sequence[TraceRequest], limits: dict) -> EmpiricalLengths:
    return EmpiricalLengths(pairs=np.array([(r.input_len, r.output_len) for r in rows]), **limits)


def map_models(rows: Sequence[TraceRequest], deployed: Sequence[str],
               mapping: Mapping[str, str] | str = "round_robin") -> list[TraceRequest]:
    """Rename trace models onto deployed ones.

    mapping: a dict {trace name: deployed name} (every trace name must be in it);
    "round_robin": trace names in order of first appearance go to deployed[0], [1], ...;
    "hash": crc32(trace name) % len(deployed), stable across runs and files.
    """
    if not deployed:
        raise ValueError("deployed models must be non-empty")
    names = list(dict.fromkeys(r.model for r in rows))
    if isinstance(mapping, Mapping):
        missing = [n for n in names if n not in mapping]
        if missing:
            raise ValueError(f"model mapping has no entry for trace models {missing}")
        bad = sorted({mapping[n] for n in names} - set(deployed))
        if bad:
            raise ValueError(f"model mapping targets {bad}, which are not deployed {list(deployed)}")
        table = dict(mapping)
    elif mapping == "round_robin":
        table = {n: deployed[i % len(deployed)] for i, n in enumerate(names)}
    elif mapping == "hash":
        table = {n: deployed[zlib.crc32(n.encode()) % len(deployed)] for n in names}
    else:
        raise ValueError(f"mapping must be a dict, 'round_robin' or 'hash', got {mapping!r}")
    return [TraceRequest(r.arrival_s, table[r.model], r.input_len, r.output_len) for r in rows]


def read_trace(path: str | Path, *, deployed: Sequence[str] | None = None,
               mapping: Mapping[str, str] | str = "round_robin",
               popularity: Popularity | None = None, seed: int = 0,
               speedup: float = 1.0, start_s: float = 0.0, end_s: float | None = None,
               max_requests: int | None = None, drop_failed: bool = True) -> Workload:
    """A trace file as a Workload ready to replay.

    Order of operations: read and sort by arrival, spread requests sharing a timestamp over
    its tick (spread_ties); cut the window [start_s, end_s) in the
    trace's own time and re-base it to 0; keep the first max_requests; divide times by
    `speedup`; then give models: traces without a model column (Azure) draw one per
    request from `popularity` over `deployed` (default LongTail, seeded by `seed`), the
    others are renamed by `mapping` when `deployed` is given.
    """
    schema, rows = read_rows(path, drop_failed=drop_failed)
    rows.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    rows = spread_ties(rows, RESOLUTION_S[schema])
    workload = Workload(tuple(rows)).window(start_s, end_s, max_requests)
    if speedup != 1.0:
        workload = workload.time_scaled(speedup)
    rows = list(workload)
    if any(r.model == UNASSIGNED_MODEL for r in rows):
        if not deployed:
            raise ValueError(f"{path} has no model column: pass deployed models to assign")
        pop = popularity or (LongTail() if len(deployed) > 1 else None)
        names = (sample_models(pop, deployed, len(rows), np.random.default_rng(seed))
                 if pop else [deployed[0]] * len(rows))
        rows = [TraceRequest(r.arrival_s, m, r.input_len, r.output_len) for r, m in zip(rows, names)]
    elif deployed:
        rows = map_models(rows, deployed, mapping)
    logger.info("trace %s: %d requests over %.1f s", path, len(rows),
                rows[-1].arrival_s if rows else 0.0)
    return Workload(tuple(rows))
